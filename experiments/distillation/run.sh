#!/usr/bin/env bash
# The distillation study (README.md): a teacher on digits, then a small student with and without distillation,
# eight seeds each. Writes under outputs/distillation/ (not committed); report.py reads it.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=outputs/distillation
# The teacher: the embedded default (make train's model and recipe, 300 epochs, seed 42), trained once.
[ -f $OUT/teacher/metrics.json ] || $PY -m vitlab.train experiment=digits progress_bar=none hydra.run.dir=$OUT/teacher
TEACHER=$($PY -c "import json; print(json.load(open('$OUT/teacher/metrics.json'))['tested_checkpoint'])")
# The student: half the width and half the depth (dim 32, depth 2, 2 heads; 27K parameters), 100 epochs.
SEEDS=1,2,3,4,5,6,7,8
STUDENT="experiment=digits progress_bar=none trainer.max_epochs=100 model.embed_dim=32 model.depth=2 model.num_heads=2"
$PY -m vitlab.train -m $STUDENT seed=$SEEDS hydra.sweep.dir=$OUT/none
$PY -m vitlab.train -m $STUDENT seed=$SEEDS model.distilled=true objective=distill objective.type=hard objective.teacher=$TEACHER \
  hydra.sweep.dir=$OUT/token_hard
$PY -m vitlab.train -m $STUDENT seed=$SEEDS objective=distill objective.type=soft objective.tau=2.0 objective.teacher=$TEACHER \
  hydra.sweep.dir=$OUT/logits_soft
$PY experiments/distillation/report.py $OUT
