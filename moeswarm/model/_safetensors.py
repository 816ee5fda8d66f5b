"""Zero-copy reading of safetensors files through a memory map.

``safetensors.safe_open(framework="np").get_tensor`` copies the whole tensor into anonymous
memory (measured: a 1 GiB expert stack costs 1 GiB of RSS), and only ``get_slice`` stays lazy.
The engine needs every tensor as a plain ``np.ndarray`` view whose pages the kernel reads on
first touch and can drop again, so the file is mapped once with ``np.memmap`` and each tensor is
a view at its offset.  The header (8-byte little-endian length + JSON) is the only thing read
eagerly; it is validated against the file size so a truncated file fails at open, naming it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import CheckpointError

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # FP8 checkpoints (moeswarm.model._stored)
}
MAX_HEADER_BYTES = 16 * 1024 * 1024
"""Largest JSON header read (the format allows 100 MB): ~100,000 tensors in one file. A header
is parsed only if it also holds at most one JSON array or object per ``_BYTES_PER_CONTAINER``
bytes (a tensor entry is one object and two arrays in 49 bytes or more), so its parse costs
about what a real checkpoint's does: 48 MiB of ``[]`` is refused before ``json.loads``."""
_BYTES_PER_CONTAINER = 12


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: enough to name it in an error message."""

    path: str  # the .safetensors file
    key: str  # the tensor's name inside that file


class SafetensorsFile:
    """One memory-mapped ``.safetensors`` file.  ``tensor(key)`` returns a read-only view."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise CheckpointError("safetensors file is truncated: no header", path=self.path)
                (n,) = struct.unpack("<Q", head)
                if 8 + n > size:
                    raise CheckpointError("safetensors file is truncated or corrupt: bad header length", path=self.path)
                if n > MAX_HEADER_BYTES:
                    raise CheckpointError(f"safetensors header of {n} bytes (at most {MAX_HEADER_BYTES})", path=self.path)
                raw = fh.read(n)
                containers = raw.count(b"[") + raw.count(b"{")
                if containers * _BYTES_PER_CONTAINER > n + 2 * _BYTES_PER_CONTAINER:
                    raise CheckpointError(f"safetensors header holds {containers} JSON arrays/objects in {n} bytes "
                                          f"(a checkpoint's holds at most one per {_BYTES_PER_CONTAINER} bytes)",
                                          path=self.path)
                header = json.loads(raw)
        except FileNotFoundError:
            raise CheckpointError("file not found", path=self.path) from None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise CheckpointError("safetensors header is not valid JSON", path=self.path) from None
        if not isinstance(header, dict):
            raise CheckpointError("safetensors header is not a JSON object", path=self.path)
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        data_len = size - self._data_start
        for key, info in header.items():
            self._entries[key] = self._parse_entry(key, info, data_len)
        # One read-only mapping for the whole file; views below never copy.
        self._map = (
            np.memmap(self.path, dtype=np.uint8, mode="r") if size > 0 else np.zeros(0, np.uint8)
        )

    def _parse_entry(self, key: str, info: object, data_len: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
        try:
            dtype = _DTYPES[info["dtype"]]  # type: ignore[index]
            shape = tuple(int(d) for d in info["shape"])  # type: ignore[index]
            begin, end = (int(x) for x in info["data_offsets"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError("unsupported dtype or malformed header entry", path=self.path, tensor=key) from None
        if end > data_len:
            raise CheckpointError(
                f"safetensors file is truncated: tensor ends at byte {end} of {data_len}", path=self.path, tensor=key
            )
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or begin < 0:
            raise CheckpointError("tensor byte range does not match its shape", path=self.path, tensor=key)
        return dtype, shape, begin, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> np.dtype:
        return self._entries[key][0]

    def tensor(self, key: str) -> np.ndarray:
        """A read-only, zero-copy view of ``key``: nothing is read until it is touched."""
        dtype, shape, begin, end = self._entries[key]
        start = self._data_start + begin
        buf = self._map[start : self._data_start + end]
        return buf.view(dtype).reshape(shape) if shape else buf.view(dtype).reshape(())


def open_folder(folder: str | os.PathLike[str]) -> dict[str, tuple[SafetensorsFile, str]]:
    """Map every safetensors shard of a Hugging Face model folder.

    Uses ``model.safetensors.index.json`` when present (and checks every shard it names exists),
    else every ``*.safetensors`` file.  Returns ``{tensor key: (file, key)}``.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError("malformed safetensors index", path=str(index)) from None
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
        weight_map = None
    if not names:
        raise CheckpointError("no *.safetensors files in the model folder", path=str(folder))
    files = {name: SafetensorsFile(folder / name) for name in names}
    out: dict[str, tuple[SafetensorsFile, str]] = {}
    for f in files.values():
        for key in f.keys():
            out[key] = (f, key)
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in out:
                raise CheckpointError("tensor listed in the index is missing from its shard", path=str(folder / name), tensor=key)
    return out
