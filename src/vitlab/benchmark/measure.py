"""Measuring on a device: synchronised timers, the attainable matmul FLOP/s (the MFU denominator),
tensor and per-step peak memory, medians, and the software environment a result was taken in."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from vitlab.utils.cuda import check_device

MB = 2**20


def pick_device(name: str) -> torch.device:
    return torch.device(check_device("benchmark.device", name, auto=True))


def sync(device: torch.device) -> None:
    """Wait for queued kernels: a GPU timer that skips this measures the launch, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], Any], device: torch.device, steps: int = 1) -> float:
    """Seconds per call of `fn`, over `steps` back-to-back calls."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / steps


def peak_matmul_flops(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 10) -> dict:
    """The device's attainable FLOP/s (the MFU denominator, measured rather than taken from a
    datasheet): the fastest of `repeats` timed (size x size) @ (size x size) products in `dtype`. The
    fastest, not the median: a peak is what the device can do, and load from elsewhere only slows."""
    size = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    seconds = min(time_once(lambda: a @ b, device) for _ in range(repeats))
    return {"dtype": str(dtype).removeprefix("torch."), "size": size, "flops_per_s": 2 * size**3 / seconds}


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views and shared weights counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def quiet_kineto():
    """The profiler's C++ backend writes start/stop and GPU-probe lines straight to file descriptor 2;
    hold them back and pass on anything else."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines(keepends=True):
                if not KINETO_NOISE.match(line):
                    sys.stderr.write(line)


KINETO_NOISE = re.compile(r"^(USDT|INFO|WARNING|ERROR):\d{4}-\d\d-\d\d \S+ \d+:\d+ \w+\.cpp:\d+\]")


def step_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak of the memory allocated by one call of `fn`, above what was allocated before it. On CUDA from
    the caching allocator's statistics; on CPU from the profiler's allocation events, summed in time
    order (the same quantity: live tensor bytes, allocator slack excluded)."""
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with quiet_kineto(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def summarise(times: list[float]) -> dict[str, Any]:
    return {"median_ms": 1e3 * statistics.median(times), "times_ms": [round(1e3 * t, 4) for t in times]}


def environment(device: torch.device) -> dict[str, Any]:
    import lightning
    import timm

    env = {
        "torch": torch.__version__,
        "timm": timm.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env
