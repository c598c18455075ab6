"""The one way vitlab downloads anything (timm's weights from the Hugging Face hub, CIFAR through torchvision):
inside `downloading(message)`, an error that says "no network" becomes the one-line OfflineError `message`;
every other error is left as it is (a full disk or a bug keeps its traceback)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from urllib.parse import urlparse

from vitlab.utils.errors import OfflineError


@contextlib.contextmanager
def downloading(message: str) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        if looks_offline(e):
            raise OfflineError(message) from e
        raise


def looks_offline(e: BaseException) -> bool:
    """Whether `e`, or an error it was raised from, is one of the HTTP stacks' ways of saying "no network"."""
    offline = _offline_errors()
    return any(isinstance(x, offline) for x in _chain(e))


def _offline_errors() -> tuple[type[BaseException], ...]:
    """What the Hugging Face hub and the HTTP stacks under it raise without a network (the ones installed here;
    each is optional). urllib (torchvision's downloads) raises URLError from the socket's own error."""
    kinds: list[type[BaseException]] = [ConnectionError, TimeoutError, socket.gaierror]
    for module, names in (
        ("huggingface_hub.errors", ("LocalEntryNotFoundError", "OfflineModeIsEnabled")),
        ("requests.exceptions", ("ConnectionError", "Timeout")),
        ("httpx", ("ConnectError", "TimeoutException")),
        ("urllib3.exceptions", ("MaxRetryError", "NameResolutionError", "NewConnectionError")),
    ):
        try:
            mod = __import__(module, fromlist=list(names))
        except ImportError:
            continue
        kinds += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return tuple(kinds)


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def unless_hub_reachable_read_the_cache() -> None:
    """Without a network, huggingface_hub retries each request for about a minute before it gives up (50 s for one
    timm name, measured): look for the hub once, in 2 s, and if it cannot be reached let huggingface_hub read its
    cache alone, as HF_HUB_OFFLINE=1 does (timm's weights; `datasets`' Hub datasets: its own copy of the flag too,
    34 s of retries otherwise). (Behind a proxy the look would mislead: it is left to the hub.)"""
    from huggingface_hub import constants

    proxy = any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if constants.is_offline_mode() or proxy:
        return
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=2).close()
    except OSError:
        constants.HF_HUB_OFFLINE = True
        if "datasets" in sys.modules:  # (datasets reads its own copy, made when it was imported)
            sys.modules["datasets"].config.HF_HUB_OFFLINE = True
