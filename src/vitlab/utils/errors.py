"""The one error policy of vitlab's commands.

Our own checks of what a user asked for raise `UserError` (or one of its two file/network flavours);
the entry points turn exactly these, and Hydra/OmegaConf config errors, into a one-line `error: ...`
and exit 2. Everything else is a bug, in our code or below it, and keeps its traceback (exit 1).

`UserError` is a `ValueError`, `MissingFileError` also a `FileNotFoundError` and `OfflineError` also a
`ConnectionError`, so library callers that catch the built-in kinds keep working. Hydra and OmegaConf are
imported only by the functions that translate their errors (the commands call them): model, data and
conversion code may raise these without depending on anything.
"""

from __future__ import annotations

import sys


class UserError(ValueError):
    """Bad input: a config value, a file or a request this machine cannot serve. The message names
    the value and what is allowed; it is the whole report."""

    exit_code = 2


class Interrupted(UserError):
    """The user stopped a command (Ctrl-C) outside training's own handling: one line saying what is left, exit 130
    (128 + SIGINT), as a stopped training run exits."""

    exit_code = 130


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (or is of the wrong kind)."""


class OfflineError(UserError, ConnectionError):
    """Something had to be downloaded, and there is no network."""


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
