"""Where Loom keeps what it makes once per machine: the built kernels, converted tokenizers and
measured panel thresholds."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$LOOM_CACHE, else $XDG_CACHE_HOME/loom, else ~/.cache/loom."""
    return Path(os.environ.get("LOOM_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loom")
