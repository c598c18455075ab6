#!/usr/bin/env bash
# The Gram anchoring study (README.md): DINO pretraining on data=segmentation's embedded canvases, with and without
# DINOv3's Gram anchoring (objective.gram), 3 seeds, a checkpoint every 4 epochs; then each checkpoint's teacher scored
# by k-NN on its class token (vitlab.eval task=knn) and by DINOv2's linear segmentation probe on its patch tokens
# (task=segmentation); each seed's initialisation too (a run with learning rate 0: epoch 0). Hydra -m sweeps: one
# process each, the jobs in turn.
# Writes under outputs/gram/ (not committed); report.py reads it. A 2-core CPU: OMP_NUM_THREADS=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/gram}
SEEDS=${SEEDS:-1,2,3}
export OMP_NUM_THREADS=1
BASE=(
  experiment=dino_pretrain_digits data=segmentation '~data.shift' 'data.canvases=[512,256,256]'  # 8 steps an epoch
  model.img_size=32 model.patch_size=8 objective.crops.local_size=16                 # 4x4 patches; local crops 2x2
  progress_bar=none test=false callbacks=default callbacks.model_checkpoint.monitor=val/loss
  callbacks.model_checkpoint.mode=min
)
TRAIN=(
  "${BASE[@]}" trainer.max_epochs=16 scheduler.warmup_epochs=2
  '+callbacks.every._target_=lightning.pytorch.callbacks.ModelCheckpoint' '+callbacks.every.dirpath=${paths.output_dir}/epochs'
  '+callbacks.every.filename="e{epoch}"' +callbacks.every.every_n_epochs=4 +callbacks.every.save_top_k=-1
  +callbacks.every.auto_insert_metric_name=false
  objective.gram.start=32 objective.gram.update_every=32                               # from epoch 5, refreshed every 4
)
[ -f "$OUT/train/summary.json" ] || $PY -m vitlab.train -m "${TRAIN[@]}" seed=$SEEDS objective.gram.loss_weight=0,1 \
  hydra.sweep.dir=$OUT/train 'hydra.sweep.subdir=seed${seed}_gram${objective.gram.loss_weight}'
[ -f "$OUT/random/summary.json" ] || $PY -m vitlab.train -m "${BASE[@]}" seed=$SEEDS optim.lr_base=0 trainer.max_epochs=1 \
  hydra.sweep.dir=$OUT/random 'hydra.sweep.subdir=seed${seed}'                       # epoch 0: each seed's initialisation
[ -f "$OUT/random_eval/summary.json" ] || $PY -m vitlab.eval -m ckpt_path=$(ls $OUT/random/seed*/checkpoints/last.ckpt | paste -sd, -) \
  task=knn,segmentation segmentation.iterations=500 segmentation.warmup_iters=50 hydra.sweep.dir=$OUT/random_eval
CKPTS=$(ls $OUT/train/seed*/epochs/e*.ckpt | paste -sd, -)
[ -f "$OUT/eval/summary.json" ] || $PY -m vitlab.eval -m ckpt_path=$CKPTS task=knn,segmentation \
  segmentation.iterations=500 segmentation.warmup_iters=50 hydra.sweep.dir=$OUT/eval
$PY experiments/gram/report.py $OUT
