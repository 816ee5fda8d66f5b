"""``moeswarm demo --export DIR``: a copy of the shipped checkpoint where a newcomer can see it."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import ConfigError
from . import CHECKPOINT


def export_checkpoint(dest: str | Path) -> Path:
    """Copy the demo checkpoint's files into ``dest`` (created if missing) and return its path.

    Refuses a ``dest`` that is a file or a folder with anything in it: nothing is overwritten."""
    target = Path(dest).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"cannot export the demo to {target}: it is a file, not a folder")
    if target.is_dir() and any(target.iterdir()):
        raise ConfigError(f"cannot export the demo to {target}: the folder is not empty "
                          "(choose a new or empty folder; nothing was overwritten)")
    target.mkdir(parents=True, exist_ok=True)
    for src in sorted(CHECKPOINT.iterdir()):
        if src.is_file():
            shutil.copy2(src, target / src.name)
    return target
