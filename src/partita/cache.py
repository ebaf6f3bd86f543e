"""On-disk cache of measurements, so that a second run of the same model on the same hardware skips them.

Entries are small JSON files under $PARTITA_CACHE_DIR (default ~/.cache/partita), named by a hash of what
determines the measurement: the graph's block signatures (structure, shapes, dtypes), the micro-batch sizes,
the device, the torch version, and for links the backend and the layout of the ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from partita import settings


def cache_dir() -> Path:
    return settings.cache_dir()


def key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def load(kind: str, name: str) -> str | None:
    path = cache_dir() / f"{kind}-{name}.json"
    try:
        return path.read_text()
    except OSError:
        return None


def store(kind: str, name: str, text: str) -> None:
    """Write atomically: a crash mid-write never leaves a half entry behind."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{kind}-{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, directory / f"{kind}-{name}.json")
    except OSError:
        pass  # a read-only home: measure again next time
