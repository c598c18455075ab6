"""Which process of a launch this is, and where rank 0's run directory is, settled before Hydra starts.

One process owns a run's directory (rank 0): a plain command claims a new one (cli/rundir.py), or the explicit
hydra.run.dir it was given. Every other process of the launch writes into the same directory and claims nothing:

- Lightning's DDP children (LOCAL_RANK > 0; NODE_RANK > 0 on other nodes) are started with rank 0's
  hydra.run.dir on their command line;
- torchrun's other processes (RANK > 0, on this node or another) read it from torchrun's own key-value store,
  where rank 0 puts it as soon as Hydra has made it (`task_started`);
- processes that Slurm's srun started together (SLURM_PROCID > 0) are given it on the command line; without
  one the whole step is refused in one line, since the tasks have no way to agree (vitlab's Slurm launcher,
  hydra/launcher=slurm, gives every task of a job its directory).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

from vitlab.utils.errors import fail

# How long a torchrun process waits for rank 0 to make the run directory.
RENDEZVOUS_TIMEOUT = timedelta(minutes=30)


def process_rank() -> int:
    """0 for the process that owns the run directory; this process's rank among those of its launch otherwise."""
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK"):  # torchrun; Lightning's DDP children, here and on other nodes
        if int(os.environ.get(key) or 0) > 0:
            return int(os.environ["RANK"]) if os.environ.get("RANK") else int(os.environ[key])
    if int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1) > 1:  # one of several tasks srun started
        return int(os.environ.get("SLURM_PROCID") or 0)
    return 0


def torchrun_store():
    """torchrun's own key-value store (its agent's), which every process of the launch reaches, or None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return None
    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=RENDEZVOUS_TIMEOUT
    )


def _run_dir_key() -> str:
    return f"vitlab/run_dir/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def task_started() -> None:
    """In the task, once Hydra has made the run directory. Rank 0 under torchrun puts it where the other processes
    wait for it. A secondary task of a Slurm job (vitlab's launcher runs each task as the same Hydra job) logs to a
    file of its own, as Lightning's DDP children do, not into the primary's."""
    from hydra.core.hydra_config import HydraConfig

    rank = process_rank()
    if rank == 0 and int(os.environ.get("WORLD_SIZE") or 1) > 1 and (store := torchrun_store()) is not None:
        store.set(_run_dir_key(), HydraConfig.get().runtime.output_dir)
    if rank > 0 and os.environ.get("SUBMITIT_EXECUTOR"):
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
            path = Path(handler.baseFilename)
            own = logging.FileHandler(path.with_name(f"{path.stem}_rank{rank}{path.suffix}"))
            own.setFormatter(handler.formatter)
            own.setLevel(handler.level)
            root.removeHandler(handler)
            handler.close()
            root.addHandler(own)


def primary_run_dir(rank: int) -> str:
    """The run directory of rank 0, as torchrun's store has it; refused in one line where there is no way to know."""
    store = torchrun_store()
    if store is not None:
        try:
            return store.get(_run_dir_key()).decode()
        except (RuntimeError, OSError) as e:  # the store went away: rank 0 stopped (its output says why)
            fail(f"process {rank} of torchrun got no run directory from rank 0, which stopped before making one ({e})")
    fail(
        f"this is process {rank} of several started together, which have no way to agree on one run directory: "
        "give them all the same hydra.run.dir (e.g. hydra.run.dir=outputs/train/runs/$SLURM_JOB_ID), start them "
        "with torchrun, or on Slurm use vitlab's launcher (python -m vitlab.train -m hydra/launcher=slurm ...)"
    )
    raise AssertionError  # fail() has exited
