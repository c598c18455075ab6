#!/bin/bash
# experiments/peft: one self-supervised start (the repo's DINO recipe on the digits, experiment=dino_pretrain_digits:
# no labels seen), then each way of fine-tuning it on the labelled digits, a task it was not trained for, SEEDS seeds
# each (CPU); then: python experiments/peft/table.py $OUT
set -e
PY="${PYTHON:-python}"
OUT=${OUT:-outputs/peft-study}
SEEDS=${SEEDS:-"1 2 3"}
EPOCHS=${EPOCHS:-10}
[ -f "$OUT/base/checkpoints/last.ckpt" ] || \
  $PY -m vitlab.train experiment=dino_pretrain_digits seed=0 progress_bar=none hydra.run.dir=$OUT/base
BASE=$OUT/base/checkpoints/last.ckpt
run() {
  name=$1; shift
  for s in $SEEDS; do
    [ -f "$OUT/$name/seed$s/metrics.json" ] && continue
    $PY -m vitlab.train model.pretrained=$BASE model.img_size=16 model.patch_size=4 trainer.max_epochs=$EPOCHS \
      seed=$s progress_bar=none "$@" hydra.run.dir=$OUT/$name/seed$s
  done
}
run full
run lora_r4 peft=lora peft.rank=4
run lora_r16 peft=lora peft.rank=16
run dora peft=dora peft.rank=4
run bitfit peft=bitfit
run last2 peft=partial peft.blocks=2
run probe peft=partial peft.blocks=0
