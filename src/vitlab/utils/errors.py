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
    """The user stopped a command (Ctrl-C) outside training's own handling: one line saying what is left, exit 130
    (128 + SIGINT), as a stopped training run exits."""

    exit_code = 130


class CtrlC(KeyboardInterrupt):
    """Ctrl-C while a command runs (`ctrl_c_as_ours`): a KeyboardInterrupt of our own type."""


def _raise_ctrl_c(signum: int, frame: object) -> None:
    raise CtrlC


@contextlib.contextmanager
def ctrl_c_as_ours():
    """Ctrl-C raises CtrlC instead of Python's KeyboardInterrupt, so that a command that caught it exits with its
    own code (130). Python's, raised in code compiled from a string (a dataclass's generated __init__ while a module
    is imported, a namedtuple), is marked by CPython as unhandled even once caught, and `python -m` then ends the
    process by SIGINT instead (CPython's run_eval_code_obj marks exactly KeyboardInterrupt, not a subclass). Where
    Ctrl-C is ignored (a background job) or already handled by someone else, it stays so."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    previous = signal.signal(signal.SIGINT, _raise_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def is_ctrl_c(e: BaseException | None) -> bool:
    """Whether `e` is Ctrl-C or an error raised from it: Python 3.11 turns an interrupt inside a class's
    __set_name__ (a dataclass's fields, while a module is imported) into a RuntimeError caused by it."""
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__cause__
    return False


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


class NonFiniteLossError(UserError):
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
