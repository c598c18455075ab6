"""Every command once as a real new process, as a user's shell starts it (issue 64 point 5): not forked from
tests/forkserver.py, which has the libraries imported already and serves a DDP run's second process from a copy of the
first. Each imports what it needs itself, reads its config and ends with its result, on the suite's cached checkpoint
and image folder; `python -m vitlab <command>` once (predict); and a two-process run launched by Lightning, whose
second process is a real `python -m vitlab.train`, equals the same run with the fork server's spare as rank 1."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from tests.benchmark.test_benchmark import TINY
from tests.end_to_end.test_signal_resume import DIGITS, TWO
from tests.helpers.commands import ROOT, _fork_server
from tests.helpers.runs import assert_same_run, digits_checkpoint, trained


def fresh(*argv: str, cwd=ROOT) -> subprocess.CompletedProcess:
    """`python -m <argv>` in a new interpreter, output captured; exit 0 asserted."""
    r = subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory)


def test_eval(ckpt, tmp_path):
    fresh("vitlab.eval", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path}")
    assert 0.15 < json.loads((tmp_path / "metrics.json").read_text())["test/acc"] <= 1  # (10 classes; 1 epoch)


def test_predict_through_python_m_vitlab(ckpt, tmp_path):
    digit = (load_digits().images[0] * 255 / 16).astype(np.uint8)  # a 0
    Image.fromarray(digit).resize((32, 32)).convert("RGB").save(photo := tmp_path / "zero.png")
    fresh("vitlab", "predict", f"ckpt_path={ckpt}", f"images=[{photo}]", "top_k=3", f"hydra.run.dir={tmp_path / 'p'}")
    (predicted,) = json.loads((tmp_path / "p" / "predictions.json").read_text())
    assert predicted["image"] == str(photo) and len(predicted["top_k"]) == 3


def test_export(ckpt, tmp_path):
    r = fresh("vitlab.export", f"ckpt_path={ckpt}", "format=timm", f"output={tmp_path / 'timm'}", cwd=tmp_path)
    assert r.stdout.strip().splitlines()[-1].startswith(f"wrote {tmp_path / 'timm'}: timm.create_model(")
    assert (tmp_path / "timm" / "config.json").is_file()


def test_visualize(ckpt, tmp_path):
    r = fresh("vitlab.visualize", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path}")
    written = [line.removeprefix("wrote ") for line in r.stdout.splitlines() if line.startswith("wrote ")]
    assert written and all(path.endswith(".png") and os.path.getsize(path) > 1000 for path in written)


def test_benchmark(tmp_path):
    quick = ["benchmark.contenders=[vitlab]", "benchmark.modes=[infer]", "benchmark.warmup=1", "benchmark.repeats=1"]
    fresh("vitlab.benchmark", *TINY, *quick, "benchmark.batch_size=2", f"hydra.run.dir={tmp_path}")
    assert json.loads((tmp_path / "benchmark.json").read_text())["results"]


def test_pack(folder, tmp_path):
    out = tmp_path / "shards"
    r = fresh("vitlab.pack", "data=imagefolder", f"data.data_dir={folder}", f"out={out}", "workers=1", cwd=tmp_path)
    assert (
        r.stdout.strip().splitlines()[-1] == f"train on them: python -m vitlab.train data=streaming data.data_dir={out}"
    )
    assert {p.name for p in out.iterdir()} >= {"train", "val", "test"}


def test_two_processes_launched_by_lightning_equal_the_run_whose_second_process_is_forked(tmp_path_factory, tmp_path):
    forked = trained(tmp_path_factory, "resumable-two", *DIGITS, *TWO)  # test_signal_resume.py's, rank 1 the spare
    fresh("vitlab.train", *DIGITS, *TWO, f"hydra.run.dir={tmp_path}")
    assert (tmp_path / "train_rank1.log").is_file()  # the second process's own log: it ran as a process of its own
    assert_same_run(forked, tmp_path)


def test_the_fork_server_still_serves_after_a_test_imported_scikit_learn_and_seeded_in_its_own_process():
    """What libraries set in this process's environment as a test runs them here (scikit-learn's import: KMP_*;
    Lightning's seed_everything: PL_GLOBAL_SEED, PL_SEED_WORKERS; its deterministic mode: CUBLAS_WORKSPACE_CONFIG;
    wandb.init: WANDB_SERVICE; a torch.compile by inductor: _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR) is read at run
    time: the commands after such a test are still forked from tests/forkserver.py, not started anew (~6 s of imports
    each, for the rest of the xdist worker's session, as after a test compiled with inductor in its own process). A
    variable read as the libraries are imported still is not served."""
    server = _fork_server({**os.environ, "PYTHONUNBUFFERED": "1"})
    assert server is not None
    set_by_libraries = {"KMP_DUPLICATE_LIB_OK": "maybe", "KMP_INIT_AT_FORK": "maybe", "PL_GLOBAL_SEED": "12345",
                        "PL_SEED_WORKERS": "1", "CUBLAS_WORKSPACE_CONFIG": ":16:8",
                        "WANDB_SERVICE": "elsewhere", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "1"}  # fmt: skip
    assert server.serves({**server.env, **set_by_libraries})
    assert not server.serves({**server.env, "OMP_NUM_THREADS": "7"})  # OpenMP's threads, set as torch is imported


PROBE = """
import os, signal, sys, time
print(os.getpid(), os.getppid(), "torch" in sys.modules, os.environ.get("SLURM_PROCID"), flush=True)
if sys.argv[1] == "wait":
    signal.signal(signal.SIGUSR2, lambda *_: print("USR2", flush=True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # (the suite started under nohup ignores it, as would its children)
    print("waiting", flush=True)
    time.sleep(120)
sys.exit(int(sys.argv[1]))
"""


def test_a_slurm_tasks_interpreter_is_forked_passes_on_its_signals_and_ends_as_its_command(tmp_path):
    """tests/slurm_task.py, as Slurm starts it in a job's task (tests/end_to_end/test_slurm.py): the task's command is
    forked from the fork server where only Slurm's and bash's variables differ, gets USR2 and TERM as Slurm sends them
    (before a time limit, as a job is requeued), ends with its command's exit code or signal, and goes when its task
    is killed; another environment gets a real interpreter."""
    server = _fork_server({**os.environ, "PYTHONUNBUFFERED": "1"})
    (tmp_path / "probe.py").write_text(PROBE)
    slurm = {"SLURM_PROCID": "1", "SLURM_JOB_ID": "5", "ENVIRONMENT": "BATCH", "TMPDIR": str(tmp_path), "SHLVL": "2"}
    served = {**os.environ, "PYTHONUNBUFFERED": "1", **slurm}

    def task(arg: str, env=served) -> tuple[subprocess.Popen, list[str]]:
        argv = [sys.executable, "-I", "-S", str(ROOT / "tests" / "slurm_task.py"), server.tasks, "-u", "-m", "probe"]
        p = subprocess.Popen([*argv, arg], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
        said = p.stdout.readline().split()
        if arg == "wait":
            assert p.stdout.readline() == "waiting\n"
        return p, said

    p, said = task("3")
    assert p.wait(60) == 3 and said[1:] == [str(server.proc.pid), "True", "1"]  # the server's child, torch imported
    p, said = task("wait")
    p.send_signal(signal.SIGUSR2)
    assert p.stdout.readline() == "USR2\n"
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 7
    p, said = task("wait")
    p.send_signal(signal.SIGHUP)  # (its default: the end of the command, and so of the task)
    assert p.wait(60) == -signal.SIGHUP
    p, said = task("wait")
    p.kill()  # Slurm's SIGKILL, KillWait after its SIGTERM
    p.wait(60)
    end = time.time() + 30
    while os.path.exists(f"/proc/{said[0]}") and time.time() < end:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{said[0]}")
    p, said = task("0", {**served, "PYTHONHASHSEED": "7"})  # read as an interpreter starts: not the server's
    assert p.wait(60) == 0 and said[:3] == [str(p.pid), str(os.getpid()), "False"]
