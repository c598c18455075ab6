"""A process that has imported torch, Lightning, torchvision, timm and Hydra once, and forks a child for each `python -m
vitlab.<command> ...` (or torchrun's `python -m torch.distributed.run ...`) that `helpers.commands.python_m` asks: the
child becomes that command (its argv, working directory, environment, process group and output files) and runs it as the
interpreter would (`runpy`, the module as __main__; an uncaught exception, SystemExit or Ctrl-C ends it as it ends
`python -m`). Each command then starts in well under a second instead of the ~6 s these imports take on a CPU of the
suite's machine; what it runs is the same code, with random generators of its own (Python's, numpy's and torch's seeded
anew from entropy: a run that forgot to seed differs from the next, as a test of two runs must see). vitlab's own
modules are imported here too (~0.4 s a command), all but the commands themselves, which the child runs as `python -m`
runs them (as __main__); a command whose working directory or PYTHONPATH holds another vitlab imports that one afresh.

Only an environment the libraries would have read alike at import is served here (run_cli compares it with this
process's own); any other, and any call where this process is not there, runs as a real subprocess. The imports
start no thread (a fork of a process with threads, an OpenMP pool among them, can hang in the child).

A command that starts more processes of its own (`subprocess.Popen` of `python -m vitlab.<command> ...`: Lightning's
DDP and FSDP launchers' ranks, torchrun's workers, a benchmark's training runs) gets them from here too: spare copies
of the child, forked before the command runs (no thread yet), one for each process it will start (_processes_started),
each become one of those processes (_Spare). Each is then the command's own child, as the real one would be, in its
process group (or a session of its own, as torchrun asks), writing to the same files or pipes.

Protocol, one JSON line each way on stdin/stdout: {"ready", "tasks"} as it starts (its pid, and the socket Slurm's
tasks ask on); {"module", "args", "cwd", "env", "own_group", "out", "err"} -> {"pid"} once forked, in the order asked;
then {"pid", "status"} (os.waitpid's) when it ended, in the order they end.

Slurm's tasks (a job submitit submits: tests/end_to_end/test_slurm.py) are forked from here too: submitit's Slurm
executor starts each task's interpreter as tests/slurm_task.py, which asks this server for it over a Unix socket
(_task_asked) and passes on the signals Slurm sends; a task starts in well under a second, not after ~8 s of imports.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import sys
import tempfile


def _serve() -> None:
    """Requests in, a child forked for each at once (several may run together: two torchrun nodes), and each child's
    end reported as it comes (SIGCHLD wakes the wait). Slurm's tasks ask on _TASKS (_task_asked)."""
    control_in, control_out = sys.stdin.fileno(), os.fdopen(os.dup(1), "w", buffering=1)
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    control_out.write(json.dumps({"ready": os.getpid(), "tasks": _TASKS[0].getsockname() if _TASKS else None}) + "\n")
    pending, running, tasks, open_ = b"", set(), {}, True
    while open_ or running or tasks:
        asking = [*_TASKS[:1], *filter(None, tasks.values())] if open_ else [*filter(None, tasks.values())]
        ready, _, _ = select.select([control_in, woken, *asking] if open_ else [woken, *asking], [], [])
        if woken in ready:
            os.read(woken, 4096)
        if control_in in ready:
            chunk = os.read(control_in, 65536)
            open_, pending = bool(chunk), pending + chunk
            if not open_:  # the tests have ended: no task is asked for any more
                _close_tasks({}, remove=True)
        if _task_asked(ready, tasks):  # this process is the task's command, forked
            for fd in (woken, wake):
                os.close(fd)
            control_out.close()
            return
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = _fork()
            if pid == 0:
                for fd in (woken, wake):
                    os.close(fd)
                control_out.close()
                _close_tasks(tasks)
                _become(json.loads(line))  # returns in the child only to run the command at the top level
                return
            running.add(pid)
            control_out.write(json.dumps({"pid": pid}) + "\n")
        for pid in list(running) + list(tasks):
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended and pid in tasks:
                _task_ended(tasks.pop(pid), status)
            elif ended:
                running.discard(pid)
                control_out.write(json.dumps({"pid": pid, "status": status}) + "\n")
    _close_tasks(tasks, remove=True)
    sys.exit(0)


# Slurm's tasks: a job submitit submits runs `<python> -u -m submitit.core._submit <folder>` in each task, <python>
# being tests/slurm_task.py (_slurm_tasks_asked), which asks this server for the task's interpreter over a Unix socket.
_TASKS: list = []  # the socket listened on
# What Slurm's job script and srun add to the submitting command's environment (bash's own among them); none is read
# as a library is imported: TMPDIR is read as a temporary file is first made, which the task's child does anew.
_SLURM_PREFIXES = ("SLURM_", "SLURMD_", "SRUN_", "SUBMITIT_", "PMI_", "PMIX_")
_SLURM_NAMES = {"ENVIRONMENT", "HOSTNAME", "PWD", "SHLVL", "_", "TMPDIR"}
_SERVED: dict[str, str] = {}  # the environment this server's imports read


def _task_asked(ready: list, tasks: dict) -> bool:
    """A task's interpreter asked for on _TASKS: forked (True in the child, which then runs the task's command) where
    its environment differs from this server's only in what is read at run time, Slurm's variables among them;
    otherwise refused (the interpreter runs as a real one). A task whose asking interpreter has ended (Slurm killed
    it: the real one would have died with it) is killed with its process group."""
    import socket

    for pid, conn in list(tasks.items()):
        if conn is not None and conn in ready:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            conn.close()
            tasks[pid] = None  # (its end is waited for as any other's)
    if not _TASKS or _TASKS[0] not in ready:
        return False
    conn, _ = _TASKS[0].accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not message.endswith(b"\n") and (more := conn.recv(1 << 16)):
        message += more
    request = json.loads(message)
    args, env = [a for a in request["args"] if a != "-u"], request["env"]
    changed = {k for k in {*env, *_SERVED} if env.get(k) != _SERVED.get(k) and not k.startswith(_SLURM_PREFIXES)}
    refused = changed - _SLURM_NAMES - READ_AT_RUN_TIME - _Spare.LAUNCHER or (args[:1] != ["-m"] and {"not python -m"})
    pid = -1 if refused or len(fds) != 3 else _fork()
    if pid == 0:
        _TASKS.pop().close()
        _close_tasks(tasks)
        conn.close()
        os.setsid()  # (a group of its own: killed with it as above)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _Spare.become({"args": [sys.executable, *args], "new_session": False, "stdio": [-1, -1, -1],
                       "cwd": request["cwd"], "env": env}, [])  # fmt: skip
        _COMMAND["rank"] = True  # (srun started every process of the task's command)
        tempfile.tempdir = None  # (the server's, found as it made its socket's folder: the task's TMPDIR decides)
        return True
    for fd in fds:
        os.close(fd)
    if pid == -1:
        conn.sendall(json.dumps({"refused": sorted(refused or ["no standard streams"])}).encode() + b"\n")
        conn.close()
        return False
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    tasks[pid] = conn
    return False


def _task_ended(conn, status: int) -> None:
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        conn.close()


def _close_tasks(tasks: dict, remove: bool = False) -> None:
    """The sockets of the tasks' interpreters, and the one listened on (in a child: they are this server's), `remove`d
    with its folder as the server ends."""
    for conn in filter(None, tasks.values()):
        conn.close()
    if _TASKS:
        listener = _TASKS.pop()
        if remove:
            os.unlink(listener.getsockname())
            os.rmdir(os.path.dirname(listener.getsockname()))
        listener.close()


def _slurm_tasks_asked() -> None:
    """A socket for Slurm's tasks to ask on, and submitit's Slurm executor starting each task's interpreter as
    tests/slurm_task.py, which asks it (where no Python is named in its place, as a container's would be)."""
    import shlex
    import socket

    from submitit.slurm import slurm

    path = os.path.join(tempfile.mkdtemp(prefix="vitlab-forkserver-"), "tasks")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    _TASKS[:] = [listener]
    shim = [sys.executable, "-I", "-S", os.path.join(os.path.dirname(os.path.abspath(__file__)), "slurm_task.py"), path]
    start = slurm.SlurmExecutor.__init__

    def __init__(self, *args, python=None, **kwargs):
        start(self, *args, python=" ".join(map(shlex.quote, shim)) if python is None else python, **kwargs)

    slurm.SlurmExecutor.__init__ = __init__


def _fork() -> int:
    """os.fork, the child's signals as a new interpreter's (no SIGCHLD handler, no wakeup fd)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    return pid


# What no library reads as it is imported (pytest's name of the running test among them): a command's environment may
# differ from this server's in these (helpers.commands.run_cli: the rest), and a spare's from its command's. Besides,
# what a library sets in the test process's own environment as a test runs it there, which the next command's
# environment then holds: scikit-learn's import sets KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK (read by Intel's
# OpenMP, which torch does not load; a command sets them itself as it imports scikit-learn), Lightning's
# seed_everything PL_GLOBAL_SEED and PL_SEED_WORKERS (read when a run seeds), its deterministic mode
# CUBLAS_WORKSPACE_CONFIG (read as cuBLAS starts), wandb.init WANDB_SERVICE (read when a run logs), a torch.compile
# of inductor's _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR (set and read as each compiled library loads). Without them,
# every command after the first test that imported scikit-learn or trained in its own process ran as a real
# subprocess (~6 s of imports each, for the rest of an xdist worker's session).
READ_AT_RUN_TIME = {"PYTHONPATH", "HYDRA_FULL_ERROR", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST",
                    "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS",
                    "CUBLAS_WORKSPACE_CONFIG", "WANDB_SERVICE",
                    # set by inductor before it loads each library it compiled, read by that library as it loads
                    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
                    # an object store's address and keys (tests/data/test_streaming.py's local S3): read as a
                    # client is made (botocore, obstore), neither of which the server imports
                    "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}  # fmt: skip

_COMMAND: dict | None = None
_INSTALLED: list[str] = []  # sys.path[1:] as the server started: the installation's entries


def _become(request: dict) -> None:
    global _COMMAND
    if request["own_group"]:
        os.setsid()
    _enter(request["cwd"], request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    _COMMAND = request
    _fresh_random_state()


def _fresh_random_state() -> None:
    """The global random generators of Python, numpy and torch seeded anew from the OS's entropy, so that a forked
    command (and each spare become a rank) does not start from the state every other child shares with this server:
    a run that forgot to seed them (a removed seed_everything) then differs from the next, and a test that two runs
    are equal catches it. (A new interpreter seeds Python's and numpy's from entropy too; torch's starts from a
    constant, which a child drawing its own only makes stricter.)"""
    import random

    import numpy
    import torch

    random.seed()
    numpy.random.seed()
    torch.seed()


def _enter(cwd: str, env: dict) -> None:
    """The working directory, environment and `python -m`'s path: the working directory first, then PYTHONPATH's
    entries, then the installation's."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *[p for p in _INSTALLED if p not in extra]]
    vitlab = sys.modules.get("vitlab")  # (imported here; gone where this command imports another)
    own = vitlab and os.path.dirname(os.path.dirname(vitlab.__file__))
    if own and any(os.path.isdir(os.path.join(p, "vitlab")) and os.path.realpath(p) != own for p in [cwd, *extra]):
        for name in [m for m in sys.modules if m == "vitlab" or m.startswith("vitlab.")]:
            del sys.modules[name]  # another vitlab comes first on this command's path: it imports that one


class _Spare:
    """A copy of the command's process, forked before the command runs, that becomes a `python -m vitlab.X` the
    command starts with subprocess.Popen (Lightning's launcher starting rank 1, torchrun a worker, a benchmark its
    training run) when Popen is asked for nothing a fork cannot give: its standard streams (pipes, files) are passed
    over the spare's socket, a new session (as torchrun starts its workers) is made here; no shell, no preexec_fn,
    no other file descriptors. And only where the environment differs from the command's own (which the server's
    imports read alike) in what is read at run time (CUBLAS_WORKSPACE_CONFIG, which Lightning's deterministic mode
    sets, among them) or in the launchers' variables (Lightning's and torchrun's: read at import only by Lightning's
    rank_zero_only, set again here as its import sets it; and OMP_NUM_THREADS, OpenMP's thread count, applied here as
    OpenMP's start applies it). Anything else runs as a real subprocess. Unasked, the spare ends when the command's
    last process does (its end of the socket closes). A spare become a command of its own (not a launcher's rank)
    has spares of its own."""

    LAUNCHER = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED",
                "PL_SEED_WORKERS", "OMP_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG",
                # torchrun's (torch/distributed/run.py, elastic/agent/server/local_elastic_agent.py,
                # elastic/multiprocessing/api.py): read as its workers run
                "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE",
                "TORCHELASTIC_SIGNALS_TO_HANDLE"}  # fmt: skip

    def __init__(self, earlier: list[_Spare]):
        import socket

        self.channel, theirs = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            self.channel.close()
            for spare in earlier:  # their channels' ends are the command's: an earlier spare asked reads to their end
                spare.channel.close()
            # Ctrl-C to the command's group while it waits (the group's processes get it) is the command's to answer
            # (a spare is not a process of the real command): it ends quietly, as an unasked spare does.
            signal.signal(signal.SIGINT, lambda *_: os._exit(0))
            asked, fds, _, _ = socket.recv_fds(theirs, 1 << 16, 3)
            while asked and (more := theirs.recv(1 << 16)):
                asked += more
            theirs.close()
            if not asked:
                os._exit(0)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.become(json.loads(asked), fds)  # returns, to run the command at the top level
        else:
            theirs.close()

    def takes(self, args, cwd, env, plain: bool, new_session: bool, stdio: tuple[int, int, int]) -> bool:
        """Whether this spare becomes the process Popen starts; `stdio`: the file descriptors Popen gives it as its
        standard input, output and error (-1: this process's), passed over the spare's socket."""
        import socket

        if self.pid == 0 or self.channel is None or not plain or not isinstance(args, (list, tuple)):
            return False
        args = [os.fspath(a) for a in args]
        if args[1:2] == ["-u"]:  # (unbuffered output: the server's environment has PYTHONUNBUFFERED)
            args = [args[0], *args[2:]]
        if args[:2] != [sys.executable, "-m"] or not args[2].startswith("vitlab."):
            return False
        env = dict(os.environ) if env is None else env  # (Popen's default: this process's environment)
        served = _COMMAND["env"]  # what the command started with: the server's environment up to READ_AT_RUN_TIME
        changed = {k for k in {*env, *served} if env.get(k) != served.get(k)}
        if changed - READ_AT_RUN_TIME - self.LAUNCHER:
            return False
        passed = sorted({fd for fd in stdio if fd != -1})
        streams = [passed.index(fd) if fd != -1 else -1 for fd in stdio]
        request = {"args": args, "cwd": os.fspath(cwd or os.getcwd()), "env": {k: str(v) for k, v in env.items()},
                   "new_session": new_session, "stdio": streams}  # fmt: skip
        socket.send_fds(self.channel, [json.dumps(request).encode()], passed)
        self.channel.close()
        self.channel = None
        return True

    @staticmethod
    def become(request: dict, fds: list[int]) -> None:
        global _COMMAND
        if request["new_session"]:
            os.setsid()
        for target, index in enumerate(request["stdio"]):
            if index != -1:
                os.dup2(fds[index], target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        _enter(request["cwd"], request["env"])
        from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

        rank_zero_only.rank = _get_rank() or 0
        if "OMP_NUM_THREADS" in os.environ:
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        _COMMAND = {"module": request["args"][2], "args": request["args"][3:], "env": request["env"]}
        if "LOCAL_RANK" in request["env"] or "RANK" in request["env"]:
            _COMMAND["rank"] = True  # a launcher's process; anything else is a command started by one (a benchmark's)
        _fresh_random_state()


def _spares_for_popen() -> None:
    """Popen's start of a child goes through _execute_child; each spare takes the first it can, in turn."""
    import subprocess

    spares: list[_Spare] = []
    for _ in range(_processes_started(_COMMAND["module"], _COMMAND["args"])):
        spare = _Spare(spares)
        if spare.pid == 0:  # this process is that spare, become one of the command's processes
            if "rank" not in _COMMAND:  # a command of its own (a benchmark's training run): its own spares
                _spares_for_popen()
            return
        spares.append(spare)
    start = subprocess.Popen._execute_child

    def execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                      shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):  # fmt: skip
        new_session = bool(rest[5]) if len(rest) > 5 else False
        plain = not shell and executable is None and preexec_fn is None
        plain = plain and not pass_fds and (len(rest) < 7 or rest[6] in (None, -1))  # no process_group
        for spare in spares:
            if spare.takes(args, cwd, env, plain, new_session, (p2cread, c2pwrite, errwrite)):
                self.pid, self._child_created = spare.pid, True
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # (as Popen's own)
                return
        start(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
              p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest)  # fmt: skip

    subprocess.Popen._execute_child = execute_child


def _processes_started(module: str, args: list[str]) -> int:
    """The processes a command starts on this host, a spare each: torchrun's --nproc-per-node; those past the first
    that a vitlab command's trainer.devices asks for (up to 8), and at least two (a launch's second process, or two
    commands one after the other: the strategies benchmark trains with DDP, then with FSDP; an unasked spare costs a
    fork)."""
    if module.startswith("vitlab."):
        devices = _number(args, "trainer.devices")
        return max(devices - 1 if devices else 1, 2)
    return _number([a.replace("_", "-") for a in args], "--nproc-per-node") or 1


def _number(args: list[str], key: str) -> int | None:
    """The number 1 to 8 that `args` give `key` (`key=N`, `+key=N`), or None."""
    values = [a.partition("=")[2] for a in args if a.lstrip("+").partition("=")[0] == key]
    return int(values[-1]) if values and values[-1].isdigit() and 0 < int(values[-1]) <= 8 else None


def _exit(code: int) -> None:
    """End as Python's exit ends a program, in what anyone sees: other threads joined, atexit callbacks run (logging's
    flush, multiprocessing's and W&B's clean-up), output flushed; but without freeing every module's objects one by
    one, which only writes to (and so copies) memory this child shares with the server, a third of a second each."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _import_vitlab() -> None:
    """Every module of vitlab but its commands (`python -m vitlab.train` runs vitlab/train.py as __main__, which runpy
    warns about where the module was imported before), and the packages' own __main__ modules likewise."""
    import importlib
    import pkgutil

    import vitlab

    commands = {f"vitlab.{m.name}" for m in pkgutil.iter_modules(vitlab.__path__) if not m.ispkg}
    for module in pkgutil.walk_packages(vitlab.__path__, "vitlab."):
        if module.name not in commands and not module.name.endswith(".__main__"):
            importlib.import_module(module.name)
    assert not commands & set(sys.modules), commands & set(sys.modules)


if __name__ == "__main__":
    _SERVED.update(os.environ)  # (as the imports below found it: some set variables of their own)
    import hydra  # noqa: F401
    import lightning.pytorch  # noqa: F401  (torch, torchmetrics, torchvision with it)
    import omegaconf  # noqa: F401
    import pydantic  # noqa: F401
    import sklearn.datasets  # noqa: F401
    import sklearn.model_selection  # noqa: F401
    import timm  # noqa: F401
    import timm.data  # noqa: F401
    import torch  # noqa: F401
    import torchvision.transforms.v2  # noqa: F401

    _import_vitlab()
    _slurm_tasks_asked()

    # What the imports made is never collected: moved out of the collector's reach, a child's collections and its
    # exit no longer touch (and so copy) the pages it shares with this process, which took ~2 s of CPU an exit.
    gc.collect()
    gc.freeze()
    _INSTALLED[:] = sys.path[1:]
    _serve()
    if _COMMAND is not None:  # the forked child: the command, as `python -m vitlab.<module>` runs it
        import runpy

        if "rank" not in _COMMAND:  # the command itself, not a spare become a rank: its spares
            _spares_for_popen()

        sys.argv = [_COMMAND["module"], *_COMMAND["args"]]
        del _serve, _become
        try:
            runpy.run_module(_COMMAND["module"], run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            if not isinstance(stop.code, (int, type(None))):
                raise  # sys.exit("message"): Python prints it
            _exit(stop.code or 0)
        _exit(0)
