"""Whether this machine has a CUDA GPU, known without importing torch where it cannot (a refusal that turns on it
comes at once), and a device name checked against the GPUs it has."""

from __future__ import annotations

from vitlab.utils.errors import UserError


def no_cuda_here() -> bool:
    """True where torch.cuda.is_available() is sure to be False, known without importing torch (seconds), so that a
    refusal that turns on it comes at once: CUDA_VISIBLE_DEVICES hides every GPU, or a Linux machine has none of
    the device files a CUDA (or ROCm) GPU is reached through (NVIDIA's /dev/nvidia<i>, ROCm's /dev/kfd, WSL's
    /dev/dxg). False where a GPU may be there: torch is asked then (on macOS and Windows always)."""
    import os
    import sys
    from pathlib import Path

    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return True
    if not sys.platform.startswith("linux"):
        return False
    dev = Path("/dev")
    return not (any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists() or (dev / "dxg").exists())


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where there cannot be a GPU (no_cuda_here)."""
    if no_cuda_here():
        return False
    import torch

    return torch.cuda.is_available()


def check_device(key: str, name: str, auto: bool = False) -> str:
    """`name` as a torch device this machine has: cpu, cuda, cuda:<i> (and with `auto`, cuda where there is a GPU,
    else cpu), or a UserError naming `key`."""
    if name == "cpu":  # (without torch's import: a refusal of something else comes at once)
        return name
    import torch

    if auto and name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"{key} {name!r} is not one of {'auto, ' if auto else ''}cpu, cuda, cuda:<i>")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        have = f"{torch.cuda.device_count()} CUDA GPU(s)" if torch.cuda.is_available() else "no CUDA GPU"
        raise UserError(f"{key} {name!r} is not available here: {have}; use cpu{' or auto' if auto else ''}")
    return name
