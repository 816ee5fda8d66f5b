"""Which checkpoints are GGUF: a ``.gguf`` file, or a folder holding exactly one and no safetensors.

A model split by llama.cpp's ``gguf-split`` (``name-00001-of-00006.gguf`` ...) counts as one file:
its first shard stands for all of them.  Kept free of the ``gguf`` library so
``checkpoint.load_weights`` can ask cheaply on every call.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError

SPLIT_NAME = "{stem}-{no:05d}-of-{count:05d}.gguf"  # llama.cpp's gguf-split (and gguf-py's writer) naming
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_paths(path: str | os.PathLike[str]) -> list[Path]:
    """All shards of the split GGUF ``path`` is one of, in order (``[path]`` when it is not split).
    Raises ``CheckpointError`` naming the first shard that is missing."""
    p = Path(path)
    m = _SPLIT.match(p.name)
    if m is None:
        return [p]
    count = int(m.group("count"))
    if count < 1 or int(m.group("no")) > count:
        raise CheckpointError(f"not a valid split GGUF name ({m.group('no')} of {count})", path=str(p))
    shards = [p.with_name(SPLIT_NAME.format(stem=m.group("stem"), no=i, count=count)) for i in range(1, count + 1)]
    for s in shards:
        if not s.is_file():
            raise CheckpointError(f"shard {s.name} of this {count}-file GGUF is missing", path=str(s))
    return shards


def find_gguf(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file ``path`` stands for (a split model's first shard), or None when it is a
    safetensors model folder."""
    p = Path(path)
    if p.suffix == ".gguf" and not p.is_dir():
        return split_paths(p)[0] if p.exists() else p  # a missing file is reported by the reader, naming it
    if not p.is_dir() or any(p.glob("*.safetensors")):
        return None
    found = sorted(p.glob("*.gguf"))
    firsts = sorted({split_paths(f)[0] for f in found})
    if len(firsts) > 1:
        names = ", ".join(f.name for f in firsts)
        raise CheckpointError(f"the folder holds {len(firsts)} GGUF files ({names}); pass one of them", path=str(p))
    return firsts[0] if firsts else None
