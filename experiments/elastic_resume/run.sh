#!/usr/bin/env bash
# Issue 78's study: a 4-process run, and the same run stopped by SIGTERM near 40% and resumed on 2 processes.
# Usage (from the repository root): OUT=outputs/elastic bash experiments/elastic_resume/run.sh
#   then: python experiments/elastic_resume/plot.py $OUT
# SignalAtStep (tests/helpers/callbacks.py) sends the signal after a given step, as a scheduler would at any time.
set -euo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-outputs/elastic}
RUN=(trainer=ddp_cpu data.batch_size=96 trainer.max_epochs=6 model.drop_path_rate=0.1 trainer.deterministic=true
     trainer.log_every_n_steps=1 progress_bar=none)
mkdir -p "$OUT"
$PYTHON -m vitlab.train "${RUN[@]}" trainer.devices=4 hydra.run.dir="$OUT/four"
KILL=(+callbacks.kill._target_=tests.helpers.callbacks.SignalAtStep +callbacks.kill.step=22
      +callbacks.kill.signum=SIGTERM +callbacks.kill.stamp="$OUT/sent")
PYTHONPATH=. $PYTHON -m vitlab.train "${RUN[@]}" trainer.devices=4 "${KILL[@]}" hydra.run.dir="$OUT/stopped" || true
PYTHONPATH=. $PYTHON -m vitlab.train "${RUN[@]}" trainer.devices=2 "${KILL[@]}" \
    ckpt_path="$OUT/stopped/checkpoints/interrupted.ckpt" hydra.run.dir="$OUT/resumed_on_2"
