#!/usr/bin/env bash
# The DINO study on the embedded digits (README.md): per seed, with one model (the digits ViT at 16 px, patch 4) and
# one budget (100 epochs), DINO pretraining (experiment=dino_pretrain_digits), MAE pretraining (experiment=
# mae_pretrain_digits at the same size), the random-weights encoder of the seed (DINO's run with a learning rate of 0,
# one epoch) and a supervised run from scratch; then k-NN and the linear probe (vitlab.eval, the evaluations as
# published) on the frozen features of all four. Writes under outputs/dino_digits/ (not committed); report.py reads it.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=outputs/dino_digits
SEEDS=${SEEDS:-1 2 3}
best() { $PY -c "import json,sys; m=json.load(open(sys.argv[1])); print(m.get('best_checkpoint') or m['tested_checkpoint'])" "$1/metrics.json"; }
SIZE="model.img_size=16 model.patch_size=4"
for s in $SEEDS; do
  D=$OUT/seed$s
  [ -f $D/dino/metrics.json ] || $PY -m vitlab.train experiment=dino_pretrain_digits seed=$s progress_bar=none hydra.run.dir=$D/dino
  [ -f $D/mae/metrics.json ] || $PY -m vitlab.train experiment=mae_pretrain_digits $SIZE seed=$s progress_bar=none hydra.run.dir=$D/mae
  [ -f $D/random/metrics.json ] || $PY -m vitlab.train experiment=dino_pretrain_digits seed=$s progress_bar=none \
    optim.lr_base=0 trainer.max_epochs=1 test=false hydra.run.dir=$D/random
  [ -f $D/supervised/metrics.json ] || $PY -m vitlab.train experiment=digits $SIZE trainer.max_epochs=100 seed=$s \
    progress_bar=none hydra.run.dir=$D/supervised
  for enc in dino mae random supervised; do
    for task in knn linear; do
      [ -f $D/${enc}_$task/metrics.json ] || $PY -m vitlab.eval ckpt_path=$(best $D/$enc) task=$task \
        linear.iterations=1500 linear.batch_size=256 hydra.run.dir=$D/${enc}_$task
    done
  done
done
$PY experiments/dino_digits/report.py $OUT
