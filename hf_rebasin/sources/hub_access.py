"""Whether the Hugging Face Hub can be asked, decided once and quickly, so that a name the Hub cannot answer
for is one line within a second rather than half a minute of retries.

The Hub is not asked when HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE, TRANSFORMERS_OFFLINE) is set, nor when one
TCP connection to its endpoint (HF_ENDPOINT, through the proxy the environment names for it) does not open
within PROBE_TIMEOUT_S.  Then only the local caches are read: a model's files from the Hub cache, a dataset from
the Hub or datasets cache.  Standard library only (the checks run before torch is imported)."""
from __future__ import annotations

import functools
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
PROBE_TIMEOUT_S = 2.0  # a refused connection or a failed DNS look-up (the usual offline) answers at once
PROBE_REUSE_S = 10.0  # a probe's answer is reused for the checks of one command, not for ever


def offline_variable() -> str | None:
    """'HF_HUB_OFFLINE=1' (the setting as written) when the user has turned the Hub off, else None."""
    for name in OFFLINE_VARIABLES:
        value = os.environ.get(name, "")
        if value.strip().lower() in ("1", "true", "yes", "on"):
            return f"{name}={value}"
    return None


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_unreachable() -> str | None:
    """None when the Hub may be asked; else why not, as a phrase (naming HF_HUB_OFFLINE where the user set it)."""
    setting = offline_variable()
    if setting:
        return f"{setting} is set, so the Hub is not asked"
    why = _probe(endpoint(), int(time.monotonic() // PROBE_REUSE_S))
    return None if why is None else f"the Hub at {endpoint()} cannot be reached ({why})"


@functools.lru_cache(maxsize=8)
def _probe(url: str, period: int) -> str | None:
    """Why one TCP connection to the endpoint (or the proxy that reaches it) fails, or None when it opens (asked
    again in the next `period` of PROBE_REUSE_S).  Run in a thread, so that a DNS look-up that hangs is given up
    after PROBE_TIMEOUT_S as well."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        proxied = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxied.hostname or host, proxied.port or 80
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            outcome.append(None)
        except OSError as error:
            outcome.append(f"{host}:{port}: {error.strerror or error}")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 0.5)
    return outcome[0] if outcome else f"{host}:{port}: no answer within {PROBE_TIMEOUT_S:g} s"


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repositories (HF_HUB_CACHE, else HF_HOME/hub)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def datasets_cache() -> Path:
    explicit = os.environ.get("HF_DATASETS_CACHE")
    return Path(explicit).expanduser() if explicit else hub_cache().parent / "datasets"


def cached_repo(repo_id: str, kind: str = "model") -> bool:
    """Whether the Hub cache holds a snapshot of the repository (kind: model or dataset)."""
    folder = hub_cache() / f"{kind}s--{repo_id.replace('/', '--')}" / "snapshots"
    return folder.is_dir() and any(folder.iterdir())


def cached_dataset(name: str) -> bool:
    """Whether a Hub dataset may load from the caches: its repository in the Hub cache, or a prepared copy in the
    datasets cache (a folder named after it, '/' written as '___')."""
    return cached_repo(name, "dataset") or any(
        (datasets_cache() / folder).is_dir() for folder in {name.replace("/", "___"), name.split("/")[-1]})


def any_cached_dataset() -> bool:
    """Whether either cache holds any dataset at all."""
    hub, prepared = hub_cache(), datasets_cache()
    return (hub.is_dir() and any(hub.glob("datasets--*"))) or (prepared.is_dir() and any(
        p.is_dir() and not p.name.startswith(".") for p in prepared.iterdir()))


@contextmanager
def cache_only() -> Iterator[None]:
    """The Hub libraries in offline mode (cache only, no retries) inside the block, when the Hub cannot be
    reached; the environment and their settings as they were afterwards."""
    if offline_variable() is not None or hub_unreachable() is None:
        yield
        return
    import sys
    saved = {name: os.environ.get(name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    settings = [(module, name) for module, name in (("huggingface_hub.constants", "HF_HUB_OFFLINE"),
                                                     ("datasets.config", "HF_HUB_OFFLINE"),
                                                     ("datasets.config", "HF_DATASETS_OFFLINE"))
                if module in sys.modules and hasattr(sys.modules[module], name)]
    before = [getattr(sys.modules[module], name) for module, name in settings]
    os.environ.update({name: "1" for name in saved})
    for module, name in settings:
        setattr(sys.modules[module], name, True)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        restored = dict(zip(settings, before))
        for module, name in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                             ("datasets.config", "HF_DATASETS_OFFLINE")):  # those imported inside the block too
            if module in sys.modules and hasattr(sys.modules[module], name):
                setattr(sys.modules[module], name, restored.get((module, name), False))
