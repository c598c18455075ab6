#!/bin/bash
# The feature-distillation study on digits (CPU): a self-supervised teacher (the repo's DINO recipe on the digits,
# no labels) and a supervised one (for logit distillation, which needs a classifier), six students from scratch,
# SEEDS seeds each; vitlab.eval's k-NN and linear probe of each student, its teacher probed beside it (retention).
# Usage: [PYTHON=python OUT=outputs/feature_distillation SEEDS="1 2 3" DINO=<a dino_pretrain_digits checkpoint>]
#        bash experiments/feature_distillation/run.sh; then python experiments/feature_distillation/table.py $OUT
set -e
PY=${PYTHON:-python}
OUT=${OUT:-outputs/feature_distillation}
SEEDS=${SEEDS:-"1 2 3"}
mkdir -p "$OUT"
P="model.img_size=16 model.patch_size=4"  # the DINO recipe's digits: 16 px, 4x4 patches
S="$P model.embed_dim=32 model.depth=2 model.num_heads=2 trainer.max_epochs=15 progress_bar=none"
if [ -z "$DINO" ]; then
  DINO=$OUT/dino/checkpoints/last.ckpt
  [ -f "$DINO" ] || $PY -m vitlab.train experiment=dino_pretrain_digits seed=0 progress_bar=none \
    hydra.run.dir=$OUT/dino > $OUT/dino.log 2>&1
fi
SUP=$OUT/supervised/checkpoints/last.ckpt
[ -f "$SUP" ] || $PY -m vitlab.train $P trainer.max_epochs=30 progress_bar=none seed=0 hydra.run.dir=$OUT/supervised \
  > $OUT/supervised.log 2>&1
probe() {  # k-NN and linear probe of $1's checkpoint into $1/knn, $1/linear
  for task in knn linear; do
    [ -f "$1/$task/metrics.json" ] || $PY -m vitlab.eval task=$task ckpt_path=$1/checkpoints/last.ckpt \
      linear.iterations=1500 linear.batch_size=256 "linear.n_last_blocks=[1,2]" hydra.run.dir=$1/$task > $1/$task.log 2>&1
  done
}
student() {
  name=$1; shift; mkdir -p "$OUT/$name"
  for s in $SEEDS; do
    d=$OUT/$name/seed$s
    [ -f "$d/metrics.json" ] || $PY -m vitlab.train $S seed=$s "$@" hydra.run.dir=$d > $d.log 2>&1
    probe "$d"
  done
}
D="objective=distill objective.teacher=$DINO"
student scratch
student logits objective=distill objective.type=soft objective.teacher=$SUP
student feature $D objective.kind=feature
student feature_nolabels $D objective.kind=feature data.labels=false
student tokens $D objective.kind=tokens
student tokens_nolabels $D objective.kind=tokens data.labels=false
