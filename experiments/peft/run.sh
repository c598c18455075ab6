#!/bin/bash
# experiments/peft: one pretrained start (5 epochs of the digits), then each way of fine-tuning it for 5 more (CPU);
# then: python experiments/peft/table.py $OUT
set -e
PY="${PYTHON:-python}"
OUT=${OUT:-outputs/peft-study}
$PY -m vitlab.train trainer.max_epochs=5 test=false seed=0 progress_bar=none hydra.run.dir=$OUT/base
BASE=$OUT/base/checkpoints/last.ckpt
run() { name=$1; shift; $PY -m vitlab.train model.pretrained=$BASE trainer.max_epochs=5 seed=1 progress_bar=none "$@" hydra.run.dir=$OUT/$name; }
run full
run lora_r4 peft=lora peft.rank=4
run lora_r16 peft=lora peft.rank=16
run dora peft=dora peft.rank=4
run bitfit peft=bitfit
run last2 peft=partial peft.blocks=2
run probe peft=partial peft.blocks=0
