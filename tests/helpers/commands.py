"""Running a command as a user does (`run_cli`, `python_m`: forked from tests/forkserver.py where it can), and what a
refusal, a full disk or a changed argument list look like to a test."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.forkserver import READ_AT_RUN_TIME

ROOT = Path(__file__).resolve().parents[2]


# A command run outside ROOT finds the test callbacks its command line names (tests.helpers.callbacks.<class>)
# through this.
TESTS_ON_PATH = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_cli(module: str, *args: str, **how) -> subprocess.CompletedProcess:
    """`python -m vitlab.<module> args` as python_m runs it."""
    return python_m(f"vitlab.{module}", *args, **how)


def python_m(
    module: str,
    *args: str,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: int = 600,
    replace_env: bool = False,
    own_group: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m <module> args` (a vitlab command, or torchrun's torch.distributed.run) in a subprocess, output
    captured. `env` is added to this process's environment, or replaces it with `replace_env`. `own_group` starts it
    in a process group (and session) of its own, as a terminal starts a command: a signal to its group then reaches
    only it. Forked from tests/forkserver.py, which has the libraries imported, where the environment allows (the same
    command, seconds sooner; the processes it starts, Lightning's ranks or torchrun's workers, too); a real
    subprocess otherwise."""
    full_env = {**({} if replace_env else os.environ), "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    argv = [sys.executable, "-m", module, *args]
    server = _fork_server(full_env)
    if server is not None:
        return server.run(argv, module, list(args), Path(cwd or ROOT), full_env, own_group, timeout)
    return subprocess.run(
        argv,
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=own_group,
    )


class _ForkServer:
    """tests/forkserver.py, started here, and its answers: the pid of each command asked (in the order asked), and
    each command's end (by pid). Commands asked from several threads run side by side."""

    def __init__(self):
        import queue

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env = {k: v for k, v in env.items() if k not in READ_AT_RUN_TIME}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "forkserver.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
            text=True,
        )
        self.forked: queue.Queue = queue.Queue()
        self.ended: dict[int, int] = {}
        self.asking, self.changed = threading.Lock(), threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.forked.get(timeout=300)
        self.tasks = ready["tasks"]  # the socket tests/slurm_task.py asks on

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            if "status" not in reply:
                self.forked.put(reply)
                continue
            with self.changed:
                self.ended[reply["pid"]] = reply["status"]
                self.changed.notify_all()

    def serves(self, env: dict) -> bool:
        return self.proc.poll() is None and {k: v for k, v in env.items() if k not in READ_AT_RUN_TIME} == self.env

    def _status(self, pid: int, timeout: float) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.ended, timeout)
            return self.ended.pop(pid, None)

    def run(self, argv, module, args, cwd, env, own_group, timeout) -> subprocess.CompletedProcess:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            request = dict(module=module, args=args, cwd=str(cwd), env=env, own_group=own_group, out=str(out),
                           err=str(err))  # fmt: skip
            with self.asking:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                pid = self.forked.get(timeout=60)["pid"]
            status = self._status(pid, timeout)
            if status is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL) if own_group else os.kill(pid, signal.SIGKILL)
                self._status(pid, 60)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            code = os.waitstatus_to_exitcode(status)
            return subprocess.CompletedProcess(
                argv, code, out.read_text(errors="replace"), err.read_text(errors="replace")
            )


_SERVER: list = []
_STARTING = threading.Lock()  # (two threads' first commands start one server)


def _fork_server(env: dict) -> _ForkServer | None:
    """This test process's fork server (started on first use) when it can run a command with `env`."""
    if os.environ.get("VITLAB_TEST_FORK", "1") == "0":
        return None
    with _STARTING:
        if not _SERVER:
            _SERVER.append(_ForkServer())
    return _SERVER[0] if _SERVER[0].serves(env) else None


def ctrl_c_as_in_a_terminal() -> None:
    """Popen's preexec_fn for a test that presses Ctrl-C (SIGINT): the command starts with SIGINT's default action,
    as a terminal starts it, whatever this test process inherited (a script's background job, `nohup ... &` or a CI
    runner may start the suite with SIGINT ignored, and the command would then ignore the test's Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_refused(r, message: str, before: dict | None = None, outputs: Path | None = None, code: int = 2) -> None:
    """A command refused as the error policy says: exit `code` (2), `message` as the start of the one line on stderr,
    no traceback, the earlier run's files (`before`, from earlier_run) as they were and, given the outputs folder,
    nothing in it but them."""
    assert r.returncode == code, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr[-3000:]
    before = before or {}
    assert {p: p.read_bytes() for p in before} == before
    if outputs is not None:
        left = {p for p in outputs.rglob("*") if p.is_file()} if outputs.exists() else set()
        assert left == set(before), sorted(map(str, left - set(before)))


def refused_without_torch(cwd: Path, args: list[str], said: str) -> subprocess.CompletedProcess:
    """`python -m vitlab.<args[0]> args[1:]` in `cwd` where torch, Lightning and timm cannot be imported (a package of
    each name that fails on import comes first on the path), refused as assert_refused says with nothing left in
    cwd/outputs: a refusal that needs no data comes before those imports (seconds on a CPU)."""
    for name in ("torch", "lightning", "timm"):
        (cwd / name).mkdir(exist_ok=True)
        (cwd / name / "__init__.py").write_text(f"raise ImportError('{name} imported')\n")
    command, *rest = args  # ("vitlab", "train", ...: the console script's way)
    module = "vitlab" if command == "vitlab" else f"vitlab.{command}"
    r = subprocess.run([sys.executable, "-m", module, *rest], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{ROOT / 'src'}"}, timeout=120)  # fmt: skip
    assert_refused(r, said, {}, cwd / "outputs")
    return r


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A small file system mounted at `path` (`options`: "size=300k", "ro,size=1m"): a full or read-only disk for
    the test; skipped where this machine cannot mount one."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def replaced(args, *overrides: str) -> list[str]:
    """`args` with `overrides` in place of the ones of the same key (a command refuses a key given twice, as a user
    would be refused: a test that changes a shared list's value says so with this), new keys appended."""
    keys = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    return [a for a in args if a.split("=", 1)[0].lstrip("+") not in keys] + list(overrides)
