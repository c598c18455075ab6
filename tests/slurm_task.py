"""A Slurm task's Python interpreter, as the suite starts it (tests/forkserver.py: _slurm_tasks_asked): run as
`python -I -S slurm_task.py <socket> -u -m submitit.core._submit <folder>`, it asks the fork server listening on
<socket> for that command, a fork of a process that has the libraries imported (a task then starts in well under a
second, not after ~8 s of imports), passing it its standard streams, working directory and environment; it then
passes on every signal Slurm sends it (USR2 before the time limit, TERM as a job is requeued or cancelled) and ends as
the command does (its exit code, or the signal that ended it). Slurm's SIGKILL ends the command too (the server sees
this process's end). Where the server is not there or does not serve it, this process becomes the interpreter itself
(exec), as if the job had named it."""

import json
import os
import signal
import socket
import sys

PASSED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
          signal.SIGCONT, signal.SIGALRM)  # fmt: skip


def main() -> None:
    path, *args = sys.argv[1:]
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED)  # (held until the command is there to pass them to)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.connect(path)
        request = {"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
        socket.send_fds(server, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        replies = server.makefile("rb")
        pid = json.loads(replies.readline() or b"{}").get("pid")
    except OSError:
        pid = None
    if pid is None:
        server.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED)
        os.execv(sys.executable, [sys.executable, *args])

    def pass_on(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in PASSED:
        signal.signal(signum, pass_on)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED)
    ended = replies.readline()
    code = os.waitstatus_to_exitcode(json.loads(ended)["status"]) if ended else 1
    if code < 0:  # ended by a signal: so does this process
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
