"""Which checkpoints are GGUF: a ``.gguf`` file, or a folder holding exactly one and no safetensors.

Kept free of the ``gguf`` library so ``checkpoint.load_weights`` can ask cheaply on every call.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError


def find_gguf(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file ``path`` stands for, or None when it is a safetensors model folder."""
    p = Path(path)
    if p.suffix == ".gguf" and not p.is_dir():
        return p  # a missing file is reported by the reader, naming it
    if not p.is_dir() or any(p.glob("*.safetensors")):
        return None
    found = sorted(p.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise CheckpointError(f"the folder holds {len(found)} GGUF files ({names}); pass one of them", path=str(p))
    return found[0] if found else None
