#!/usr/bin/env bash
# experiments/soups: one pretrained digits ViT, fine-tuned with a grid of learning rate x augmentation, for 3 seeds;
# each seed's best single fine-tune, uniform soup, greedy soup and top-3 checkpoint average scored on the test split.
#   bash experiments/soups/run.sh [outputs/soups]    then    python experiments/soups/report.py outputs/soups
set -euo pipefail
OUT=${1:-outputs/soups}
PY=${PYTHON:-python}
mkdir -p "$OUT"
# The start: 30 epochs on digits from scratch (the default recipe; its checkpoint is the pretrained weights).
[ -f "$OUT/pretrain/metrics.json" ] || $PY -m vitlab.train trainer.max_epochs=30 test=false progress_bar=none \
  hydra.run.dir="$OUT/pretrain"
PRE=$(realpath "$OUT/pretrain/checkpoints/last.ckpt")
for SEED in 0 1 2; do
  SWEEP="$OUT/seed$SEED"
  # The ingredients: 3 learning rates x 2 shift augmentations, 15 epochs each from the same weights, top 3 kept.
  $PY -m vitlab.train -m model.pretrained="$PRE" optim.lr=3e-4,1e-3,3e-3 data.shift=0,1 seed=$SEED \
    trainer.max_epochs=15 callbacks.model_checkpoint.save_top_k=3 progress_bar=none hydra.sweep.dir="$SWEEP"
  for METHOD in uniform_soup greedy_soup; do
    [ -f "$SWEEP-$METHOD/soup.json" ] || $PY -m vitlab.average method=$METHOD sweep_dir="$SWEEP" \
      hydra.run.dir="$SWEEP-$METHOD"
  done
  # The best single fine-tune (by val/acc_best) and the average of its 3 best checkpoints.
  BEST=$($PY -c "import json,sys; r=json.load(open(sys.argv[1])); print(max(r, key=lambda x: x['val/acc_best'])['job'])" \
    "$SWEEP/summary.json")
  [ -f "$SWEEP-top3/averaged.ckpt" ] || $PY -m vitlab.average run_dir="$SWEEP/$BEST" top_k=3 hydra.run.dir="$SWEEP-top3"
  [ -f "$SWEEP-top3-eval/metrics.json" ] || $PY -m vitlab.eval ckpt_path="$SWEEP-top3/averaged.ckpt" progress_bar=none \
    hydra.run.dir="$SWEEP-top3-eval"
done
