#!/usr/bin/env bash
# The first thing to run on a lent GPU (experiments/gpu/README.md), from the repository root:
#
#   make gpu-wheels                                     # here, before the lease: .whl/, what the image lacks
#   run(command="bash experiments/gpu/run.sh", carry=[".whl"], timeout_s=600)      # the device tool
#   python experiments/gpu/report.py <files_at>/results.json                        # here: the studies' tables
#
# On the device: installs the carried wheels its image lacks (experiments/gpu/wheels.py install), writes the image's
# packages and the GPU's name to $OUT, then runs experiments/gpu/points.py (each point under its own limit, all
# within DEADLINE seconds, default 540) with results in $OUT/results.json. Arguments go to points.py (--only, --dry-run).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-outputs/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
"$PY" -m pip list --format=freeze > "$OUT/image.txt" 2>/dev/null
"$PY" -c 'import platform; print("# python", platform.python_version())' >> "$OUT/image.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" experiments/gpu/wheels.py install .whl /tmp/site || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
# Every module the points import, before any point starts: a missing one is named here, in a line.
"$PY" -c 'import hydra, omegaconf, pydantic, lightning, timm, torchmetrics, torchdata, vitlab.train, vitlab.benchmark.__main__' \
  || { echo "run.sh: an import failed (above): make gpu-wheels computes what to carry"; exit 1; }
exec "$PY" experiments/gpu/points.py "$OUT" --deadline "${DEADLINE:-540}" "$@"
