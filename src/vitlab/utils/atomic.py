"""Writing a file so that a crash, a `kill -9` or a full disk never leaves half of it where a good one
was: into a temporary file beside the target, flushed and fsynced, optionally checked, then renamed
over the target. Checkpoints (plugins.AtomicCheckpointIO), exported weights (convert.weights), exported
programs (convert.export, through a temporary directory) and timm folders (convert.timm_dir) use it.
No Lightning or Hydra here."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

# A write in progress is `.<name>.tmp-<pid>` beside its target.
_TEMPORARY = re.compile(r"^\..+\.tmp-(\d+)$")
# What a full or read-only disk, or missing permissions, look like: the user's to fix.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
# What a full disk's one line advises where the writer says nothing else: a training run's checkpoint.
CHECKPOINT_ADVICE = "free space or choose another paths.log_dir (resume from an earlier checkpoint with ckpt_path=...)"


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[BinaryIO], None],
    verify: Callable[[Path], None] | None = None,
    what: str = "file",
) -> Path:
    """`write(f)` into `.<name>.tmp-<pid>`, fsync, `verify(tmp)` (raise to refuse), rename onto `path`.
    A full or read-only disk becomes a UserError saying so; the temporary file never survives."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if verify is not None:
            verify(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        _raise_disk_error(e, path, what)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_files(
    path: str | os.PathLike, write: Callable[[Path], None], what: str = "file", advice: str = CHECKPOINT_ADVICE
) -> Path:
    """For writers that make more than one file (ONNX's external weights) or open the file themselves:
    `write(tmp)` writes `tmp` (named as `path`, in a temporary directory beside it) and any side files, checks
    them and raises to refuse; then each is fsynced and renamed into place, `path` last. The directory never
    survives; a full disk is a UserError as in atomic_write, ending with `advice` (what to do instead)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    tmpdir = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmpdir.mkdir()
    try:
        write(tmpdir / path.name)
        for f in sorted(tmpdir.iterdir(), key=lambda f: f.name == path.name):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(f, path.parent / f.name)
    except (OSError, RuntimeError) as e:
        _raise_disk_error(e, path, what, advice)
        raise
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return path


def atomic_dir(
    path: str | os.PathLike, write: Callable[[Path], None], what: str = "folder", advice: str = CHECKPOINT_ADVICE
) -> Path:
    """For a folder of files (timm's format): `write(tmp)` fills `.<name>.tmp-<pid>` beside `path`, checks it and
    raises to refuse; then its files are fsynced and it is renamed into place, replacing a folder at `path`. The
    folder and its files get the permissions the umask gives any new file, as a checkpoint has (writers that make
    theirs 0600, safetensors', would leave a model nobody else on a shared machine can read). The temporary never
    survives; a full disk is a UserError as in atomic_write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()  # 0777 less the umask (tempfile.mkdtemp's is 0700)
        write(tmp)
        for f in tmp.iterdir():
            f.chmod(tmp.stat().st_mode & 0o666)  # what open() would have made: 0666 less the umask
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _replace_dir(tmp, path)
    except Exception as e:  # (safetensors' writer raises a SafetensorError of its own on a full disk)
        _raise_disk_error(e, path, what, advice)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _replace_dir(tmp: Path, path: Path) -> None:
    """Rename the folder `tmp` onto `path`; a folder there is moved aside first (a rename replaces none but an empty
    one) and removed once the new one is in place."""
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.is_dir():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _raise_disk_error(e: BaseException, path: Path, what: str, advice: str = CHECKPOINT_ADVICE) -> None:
    disk = disk_error(e)
    if disk is None:
        return
    kept = f"the previous {path.name} is intact" if path.exists() else f"no {path.name} was written"
    raise UserError(
        f"cannot write {what} {path} ({disk.strerror or disk}); {kept}, and no partial file is left; {advice}"
    ) from e


def atomic_link(source: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Make `path` name the same file as `source` (a hard link, placed by rename, so `path` is always
    a complete file); where the filesystem has no hard links, an atomic copy. A directory (trainer=fsdp's
    checkpoint of shards) becomes a new directory of links to its files, renamed into place whole."""
    source, path = Path(source), Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if source.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp, copy_function=_link_or_copy)
        _replace_dir(tmp, path)
        return path
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        return atomic_write(path, lambda f: f.write(source.read_bytes()), what="checkpoint")
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copy2(source, target)


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporaries of writes whose process is gone (a `kill -9` mid-save leaves one, as
    large as a checkpoint, that nothing else would ever remove)."""
    removed = []
    for path in Path(directory).glob(".*.tmp-*"):
        m = _TEMPORARY.match(path.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.info("removed %d unfinished checkpoint file(s) left by a killed save in %s", len(removed), directory)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def disk_error(e: BaseException | None) -> OSError | None:
    """The OSError of a full/read-only disk behind `e`, if any (torch.save reports a failed write as a
    RuntimeError from its C++ writer, with the OSError as its context)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            return e
        if "No space left on device" in str(e):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        e = e.__cause__ or e.__context__
    return None
