"""On PYTHONPATH with VITLAB_RECORD_IMPORTS=DIR (make gpu-wheels): each Python process that exits writes the top-level
modules it imported to DIR/<pid>.txt, for experiments/gpu/wheels.py to turn into the distributions they come from."""

import atexit
import os
import sys


def _write() -> None:
    out = os.environ.get("VITLAB_RECORD_IMPORTS")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    names = sorted({name.split(".")[0] for name in list(sys.modules)})
    with open(os.path.join(out, f"{os.getpid()}.txt"), "w") as f:
        f.write("\n".join(names))


atexit.register(_write)
