"""The one error policy of vitlab's commands.

Our own checks of what a user asked for raise `UserError` (or one of its two file/network flavours);
the entry points turn exactly these, and Hydra/OmegaConf config errors, into a one-line `error: ...`
and exit 2. Everything else is a bug, in our code or below it, and keeps its traceback (exit 1).

`UserError` is a `ValueError`, `MissingFileError` also a `FileNotFoundError` and `OfflineError` also a
`ConnectionError`, so library callers that catch the built-in kinds keep working. No imports here:
model, data and conversion code may raise these without depending on anything.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: a config value, a file or a request this machine cannot serve. The message names
    the value and what is allowed; it is the whole report."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (or is of the wrong kind)."""


class OfflineError(UserError, ConnectionError):
    """Something had to be downloaded, and there is no network."""


class NonFiniteLossError(UserError):
    """The training loss became NaN or inf: the recipe (LR, data), not the code, is to change."""
