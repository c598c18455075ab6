"""The one error policy of vitlab's commands.

Our own checks of what a user asked for raise `UserError` (or one of its two file/network flavours);
the entry points turn exactly these, and Hydra/OmegaConf config errors, into a one-line `error: ...`
and exit 2. Everything else is a bug, in our code or below it, and keeps its traceback (exit 1).

`UserError` is a `ValueError`, `MissingFileError` also a `FileNotFoundError`, `OfflineError` also a
`ConnectionError`, `UnknownArgumentError` a `TypeError` and `UnsupportedRequestError` an `AssertionError` (where
timm's callers catch those), so library callers that catch the built-in kinds keep working. Hydra and OmegaConf are
imported only by the functions that translate their errors (the commands call them): model, data and
conversion code may raise these without depending on anything.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


class UserError(ValueError):
    """Bad input: a config value, a file or a request this machine cannot serve. The message names
    the value and what is allowed; it is the whole report."""

    exit_code = 2


class Interrupted(UserError):
    """The user stopped a command (Ctrl-C, SIGTERM) outside training's own handling: one line saying what was kept
    and what to run next, exit 128 + the signal (130 for Ctrl-C), as a stopped training run exits."""

    exit_code = 130

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class CtrlC(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while a command runs (`ctrl_c_as_ours`): a KeyboardInterrupt of our own type, which
    knows its signal."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(int(signum))
        self.signum = int(signum)

    @property
    def name(self) -> str:
        """How the stop is named in the line that reports it: `Ctrl-C (SIGINT)`, `SIGTERM`."""
        return "Ctrl-C (SIGINT)" if self.signum == signal.SIGINT else signal.Signals(self.signum).name


# Ctrl-C and SIGTERM: what a terminal, `timeout`, a scheduler or torchrun's agent sends to stop a command.
AT_ONCE = (signal.SIGINT, signal.SIGTERM)
# The same stop, delivered again: GNU timeout forwards a signal to its child and again to the group, torchrun's agent
# and srun forward to workers the terminal or scheduler has already signalled (two or three copies within a
# millisecond). Within this many seconds of the first, Ctrl-C and SIGTERM are that stop; only a later one is "now".
REPEAT_WINDOW_S = 1.0


def _raise_ctrl_c(signum: int, frame: object) -> None:
    ignore_repeats()
    raise CtrlC(signum)


def ignore_repeats() -> threading.Timer:
    """After a first Ctrl-C or SIGTERM: copies of it (within REPEAT_WINDOW_S) are ignored, a later one ends the
    process at once, by the kernel (set from a timer thread: the main thread may be stuck in a step that never
    reaches Python again)."""
    for again in AT_ONCE:
        signal.signal(again, signal.SIG_IGN)
    timer = threading.Timer(REPEAT_WINDOW_S, kernel_default, args=(AT_ONCE,))
    timer.daemon = True
    timer.start()
    return timer


def kernel_default(signums: tuple[int, ...]) -> None:
    """The default action (the kernel ends the process) for `signums`, set from any thread: C's signal(), since
    Python's signal.signal works in the main thread only, which may be stuck in a step. (Python's own record of the
    handler is left as it was.)"""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype, libc.signal.argtypes = ctypes.c_void_p, (ctypes.c_int, ctypes.c_void_p)
    for signum in signums:
        libc.signal(int(signum), None)  # SIG_DFL


@contextlib.contextmanager
def ctrl_c_as_ours():
    """Ctrl-C and SIGTERM raise CtrlC instead of Python's KeyboardInterrupt (SIGTERM: instead of ending the process
    with no word), so that a command that caught it says what it kept and exits with 128 + the signal. Python's
    KeyboardInterrupt, raised in code compiled from a string (a dataclass's generated __init__ while a module is
    imported, a namedtuple), is marked by CPython as unhandled even once caught, and `python -m` then ends the
    process by SIGINT instead (CPython's run_eval_code_obj marks exactly KeyboardInterrupt, not a subclass). Where a
    signal is ignored (a background job) or already handled by someone else (submitit), it stays so."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = [s for s, python in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))
            if signal.getsignal(s) is python]  # fmt: skip
    previous = {s: signal.signal(s, _raise_ctrl_c) for s in ours}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def finishing() -> None:
    """Once a command has done its work and the process ends (Python's exit: atexit callbacks, finalizers), a Ctrl-C
    or SIGTERM is taken as a copy of the stop that may have ended it: nothing is left to keep, so no traceback from
    inside the exit; one a second later ends the process at once."""
    if threading.current_thread() is threading.main_thread():
        for s in AT_ONCE:
            if python_ctrl_c(signal.getsignal(s)) or signal.getsignal(s) is signal.SIG_DFL:
                signal.signal(s, _ending)


def _ending(signum: int, frame: object) -> None:
    ignore_repeats()


def is_ctrl_c(e: BaseException | None) -> bool:
    """Whether `e` is a stop by Ctrl-C or SIGTERM, or an error raised from one (`ctrl_c_behind`)."""
    return ctrl_c_behind(e) is not None


def ctrl_c_behind(e: BaseException | None) -> KeyboardInterrupt | None:
    """The Ctrl-C (or SIGTERM: CtrlC) behind `e`: `e` itself; the cause of an error raised from it (Python 3.11 turns
    an interrupt inside a class's __set_name__, a dataclass's fields while a module is imported, into a RuntimeError
    caused by it); or the one Lightning answered with sys.exit(1) ("Detected KeyboardInterrupt, attempting graceful
    shutdown", in a Trainer's fit set-up, test, validate or predict)."""
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return e
        e = e.__context__ if isinstance(e, SystemExit) else e.__cause__
    return None


def stop_name(e: BaseException | None) -> tuple[str, int]:
    """(how the stop behind `e` is named, its signal): `Ctrl-C (SIGINT)`, `SIGTERM`."""
    stop = ctrl_c_behind(e)
    return (stop.name, stop.signum) if isinstance(stop, CtrlC) else ("Ctrl-C (SIGINT)", int(signal.SIGINT))


def python_ctrl_c(handler: object) -> bool:
    """Whether `handler` is Python's Ctrl-C handling (its own or ours): nothing to pass a signal on to."""
    return handler is signal.default_int_handler or handler is _raise_ctrl_c


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (or is of the wrong kind)."""


class OfflineError(UserError, ConnectionError):
    """Something had to be downloaded, and there is no network."""


class UnknownArgumentError(UserError, TypeError):
    """A keyword no model takes (`create_model(name, bogus=1)`): also a TypeError, as Python's own for an unknown
    keyword, which timm's callers catch."""


class UnsupportedRequestError(UserError, AssertionError):
    """A model request timm's VisionTransformer refuses with an assertion (an unknown pool in reset_classifier, an
    attention pool added after construction): also an AssertionError, which timm's own tests catch and move on."""


class TrainingFailed(UserError):
    """Training itself went wrong on the user's recipe (not bad input refused before it began): the run directory is
    kept whatever it holds, its train.log and warnings being the explanation."""


class NonFiniteLossError(TrainingFailed):
    """The training loss became NaN or inf: the recipe (LR, data), not the code, is to change."""


def config_errors() -> tuple[type[BaseException], ...]:
    """What becomes a one-line exit 2: our own checks of the user's input, and Hydra's and OmegaConf's
    reports of a bad config or override. Anything else is a bug and keeps its traceback (exit 1)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (UserError, OmegaConfBaseException, HydraException)


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def user_error(e: BaseException) -> BaseException | None:
    """The user's mistake behind `e`, or None for a bug. Hydra wraps what a config's constructor raised,
    OmegaConf what a resolver raised: our own UserError inside either is the message to show."""
    from hydra.errors import InstantiationException
    from omegaconf.errors import OmegaConfBaseException

    cause, formatted = e, None
    # OmegaConf re-raises a resolver's error without `from`: follow the implicit context as well
    while isinstance(cause, (InstantiationException, OmegaConfBaseException)):
        if isinstance(cause, OmegaConfBaseException) and formatted is None:
            formatted = cause  # the outermost: OmegaConf fills in the key's name there, not in the ones inside
        inner = cause.__cause__ or cause.__context__
        if not isinstance(inner, (InstantiationException, OmegaConfBaseException, UserError)):
            break
        cause = inner
    if isinstance(e, InstantiationException) and cause is e:
        return None  # a constructor failed on something that is not the user's input: a bug
    if isinstance(cause, OmegaConfBaseException):
        return formatted
    return cause if isinstance(cause, config_errors()) else None


def one_line(e: BaseException) -> str:
    """An error's message as the one line `error: ...` shows."""
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    text = str(e).strip() or type(e).__name__
    if "Original Traceback" in text:  # re-raised from a DataLoader worker: its last line is the error
        text = text.splitlines()[-1].split(": ", 1)[-1]
    if isinstance(e, OmegaConfBaseException):  # its message ends with full_key/object_type lines
        text = text.splitlines()[0]
    if isinstance(e, MissingMandatoryValue) and getattr(e, "full_key", None):  # a `???` in the config
        text = f"{e.full_key} must be given: {e.full_key}=..."
    text = text.split("\nConfig search path")[0]  # Hydra's missing-option message ends with its search path
    return " ".join(text.split())


def close_matches(word: str, choices: list[str]) -> list[str]:
    """Up to three of `choices` that look like `word`, for a `did you mean` hint."""
    import difflib

    return difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
