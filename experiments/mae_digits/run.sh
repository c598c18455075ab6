#!/usr/bin/env bash
# The MAE study on the embedded digits (README.md): per seed, MAE pretraining (experiment=mae_pretrain_digits), a
# random-weights encoder of the same seed (the same run with a learning rate of 0), a supervised run from scratch;
# then k-NN, linear probe and few-shot on the frozen features of all three, and the MAE encoder fine-tuned with the
# scratch run's recipe. Writes under outputs/mae_digits/ (not committed); report.py reads it.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=outputs/mae_digits
SEEDS=${SEEDS:-1 2 3 4 5}
best() { $PY -c "import json,sys; m=json.load(open(sys.argv[1])); print(m.get('best_checkpoint') or m['tested_checkpoint'])" "$1/metrics.json"; }
CLASSIFY="experiment=digits progress_bar=none model.patch_size=2 trainer.max_epochs=100"
for s in $SEEDS; do
  D=$OUT/seed$s
  [ -f $D/mae/metrics.json ] || $PY -m vitlab.train experiment=mae_pretrain_digits seed=$s progress_bar=none hydra.run.dir=$D/mae
  [ -f $D/random/metrics.json ] || $PY -m vitlab.train experiment=mae_pretrain_digits seed=$s progress_bar=none \
    optim.lr_base=0 trainer.max_epochs=1 test=false hydra.run.dir=$D/random
  [ -f $D/scratch/metrics.json ] || $PY -m vitlab.train $CLASSIFY seed=$s hydra.run.dir=$D/scratch
  MAE=$(best $D/mae)
  [ -f $D/finetune/metrics.json ] || $PY -m vitlab.train $CLASSIFY seed=$s model.pretrained=$MAE hydra.run.dir=$D/finetune
  for enc in mae random scratch; do
    for task in knn linear fewshot; do
      # linear: the study's 1,500 steps of 256 (then linear.epochs=300; the probe now counts iterations, as DINOv2's,
      # and draws from an infinite sampler instead of epochs: the same steps, batches and lrs, another shuffle)
      [ -f $D/${enc}_$task/metrics.json ] || $PY -m vitlab.eval ckpt_path=$(best $D/$enc) task=$task \
        linear.iterations=1500 linear.batch_size=256 \
        hydra.run.dir=$D/${enc}_$task
    done
  done
done
# Seed 1's pretraining again, its representation measured on the validation split every 10 epochs.
[ -f $OUT/curve/metrics.json ] || $PY -m vitlab.train experiment=mae_pretrain_digits seed=1 progress_bar=none \
  callbacks=representation callbacks.representation.every_n_epochs=10 hydra.run.dir=$OUT/curve
[ -d $OUT/visualize ] || $PY -m vitlab.visualize ckpt_path=$(best $OUT/seed1/mae) num_images=8 hydra.run.dir=$OUT/visualize
cp $OUT/visualize/mae_reconstructions.png experiments/mae_digits/reconstructions.png
$PY experiments/mae_digits/report.py $OUT
