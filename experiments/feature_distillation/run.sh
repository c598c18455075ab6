#!/bin/bash
# The feature-distillation study on digits (CPU, one seed): a teacher, five students, vitlab.eval's k-NN of each.
# Usage: bash experiments/feature_distillation/run.sh [out folder, default outputs/feature_distillation]
set -e
OUT=${1:-outputs/feature_distillation}
mkdir -p "$OUT"
S="model.embed_dim=32 model.depth=2 model.num_heads=2 trainer.max_epochs=15 progress_bar=none seed=0"
python -m vitlab.train trainer.max_epochs=30 progress_bar=none seed=0 hydra.run.dir=$OUT/teacher > $OUT/teacher.log 2>&1
T=$OUT/teacher/checkpoints/last.ckpt
python -m vitlab.train $S hydra.run.dir=$OUT/scratch > $OUT/scratch.log 2>&1
python -m vitlab.train $S objective=distill objective.type=soft objective.teacher=$T hydra.run.dir=$OUT/logits > $OUT/logits.log 2>&1
python -m vitlab.train $S objective=distill objective.kind=feature objective.teacher=$T hydra.run.dir=$OUT/feature > $OUT/feature.log 2>&1
python -m vitlab.train $S objective=distill objective.kind=feature objective.teacher=$T data.labels=false \
    hydra.run.dir=$OUT/feature_nolabels > $OUT/feature_nolabels.log 2>&1
python -m vitlab.train $S objective=distill objective.kind=tokens objective.teacher=$T data.labels=false \
    hydra.run.dir=$OUT/tokens_nolabels > $OUT/tokens_nolabels.log 2>&1
for r in teacher scratch logits feature feature_nolabels tokens_nolabels; do
  python -m vitlab.eval task=knn ckpt_path=$OUT/$r/checkpoints/last.ckpt hydra.run.dir=$OUT/eval_$r > $OUT/eval_$r.log 2>&1
  grep -h "knn/top1_k20" $OUT/eval_$r.log | sed "s/^/$r: /"
done
