"""A process that has imported torch, Lightning, torchvision, timm and Hydra once, and forks a child for each
`python -m vitlab.<command> ...` that `helpers.run_cli` asks for: the child becomes that command (its argv, working
directory, environment, process group and output files) and runs it as the interpreter would (`runpy`, the module as
__main__; an uncaught exception, SystemExit or Ctrl-C ends it as it ends `python -m`). Each command then starts in
well under a second instead of the ~6 s these imports take on a CPU of the suite's machine; what it runs is the
same code, vitlab's own modules imported fresh in the child.

Only an environment the libraries would have read alike at import is served here (run_cli compares it with this
process's own); any other, and any call where this process is not there, runs as a real subprocess. The imports
start no thread (a fork of a process with threads, an OpenMP pool among them, can hang in the child).

Protocol, one JSON line each way on stdin/stdout: {"module", "args", "cwd", "env", "own_group", "out", "err"}
-> {"pid"} once forked, then {"status"} (os.waitpid's) when it ended.
"""

from __future__ import annotations

import json
import os
import sys


def _serve() -> None:
    control_in, control_out = sys.stdin.buffer, os.fdopen(os.dup(1), "w", buffering=1)
    control_out.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in control_in:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            control_out.close()
            _become(request)  # returns in the child only to run the command at the top level
            return
        control_out.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        control_out.write(json.dumps({"status": status}) + "\n")
    sys.exit(0)


_COMMAND: dict | None = None


def _become(request: dict) -> None:
    global _COMMAND
    if request["own_group"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # `python -m`'s path: the working directory first, then PYTHONPATH's entries, then the installation's
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *[p for p in sys.path[1:] if p not in extra]]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    _COMMAND = request


if __name__ == "__main__":
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

    _serve()
    if _COMMAND is not None:  # the forked child: the command, as `python -m vitlab.<module>` runs it
        import runpy

        sys.argv = [f"vitlab.{_COMMAND['module']}", *_COMMAND["args"]]
        del _serve, _become
        runpy.run_module(f"vitlab.{_COMMAND['module']}", run_name="__main__", alter_sys=True)
