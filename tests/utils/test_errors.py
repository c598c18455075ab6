"""utils/errors.py: Ctrl-C caught by a command ends it with the command's exit code, whatever line it interrupted
(the commands' one-line Ctrl-C exits end to end are in tests/end_to_end/test_user_errors_commands.py)."""

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.commands import ctrl_c_as_in_a_terminal
from vitlab.utils import errors

# A command run as `python -m`: Ctrl-C lands in code compiled from a string (as in a dataclass's generated __init__
# while a module is imported), the command catches it and exits 130.
COMMAND = """
    import contextlib, os, signal, sys
    from vitlab.utils.errors import ctrl_c_as_ours

    with ctrl_c_as_ours() if sys.argv[1] == "ours" else contextlib.nullcontext():
        try:
            exec("os.kill(os.getpid(), signal.SIGINT)\\nfor _ in range(1000): pass")
        except KeyboardInterrupt as e:
            print(type(e).__name__)
            raise SystemExit(130)
"""


@pytest.mark.parametrize("handling, code", [("ours", 130), ("python", -signal.SIGINT)])
def test_ctrl_c_caught_inside_code_from_a_string_exits_with_the_commands_code(tmp_path, handling, code):
    """With Python's own KeyboardInterrupt CPython ends such a process by SIGINT though it exits 130 (the pack
    command's Ctrl-C exit, once in four under load); with ctrl_c_as_ours, which the entry points use, it exits 130."""
    (tmp_path / "command.py").write_text(textwrap.dedent(COMMAND))
    argv = [sys.executable, "-m", "command", handling]
    run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, preexec_fn=ctrl_c_as_in_a_terminal)
    assert run.returncode == code, run.stderr
    assert run.stdout.strip() == ("CtrlC" if handling == "ours" else "KeyboardInterrupt")


def test_ctrl_c_as_ours_keeps_an_ignored_or_foreign_ctrl_c_and_restores_pythons():
    """A background job's ignored Ctrl-C stays ignored, another handler stays in place; Python's comes back after."""
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with errors.ctrl_c_as_ours():
            assert errors.python_ctrl_c(signal.getsignal(signal.SIGINT))
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
            with pytest.raises(errors.CtrlC):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        for other in (signal.SIG_IGN, print):
            signal.signal(signal.SIGINT, other)
            with errors.ctrl_c_as_ours():
                assert signal.getsignal(signal.SIGINT) is other
    finally:
        signal.signal(signal.SIGINT, outer)


def test_an_error_raised_from_ctrl_c_is_ctrl_c():
    """Ctrl-C inside a class's __set_name__ (a dataclass field, while a module is imported) reaches the command as a
    RuntimeError caused by it on Python 3.11, as itself on later versions: either is the user's Ctrl-C, not a bug."""

    class Field:
        def __set_name__(self, owner, name):
            raise errors.CtrlC

    with pytest.raises(BaseException) as caught:
        type("Spec", (), {"num_nodes": Field()})
    assert errors.is_ctrl_c(caught.value)
    assert not errors.is_ctrl_c(RuntimeError("a bug"))
    try:
        raise RuntimeError("cleanup failed") from ValueError("a bug")
    except RuntimeError as e:
        assert not errors.is_ctrl_c(e)
