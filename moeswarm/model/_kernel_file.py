"""The kernels' layout of a GGUF's quantized matrices, repacked once and kept on disk beside it.

Why: ``_qkernels.repack`` turns GGML blocks into ``MatMulNBits``' layout with numpy, 9-22 ms for one
Mixtral-sized expert; done at each expert's first use, every process (and every page-in of an expert that
left memory) paid it again.  Now the first process to open ``X.gguf`` repacks every matrix the kernels
compute once, writes them into ``X.gguf.kernels`` beside it, and every process memory-maps that file:
``QuantizedTensor.packed()`` is then a view of its bytes, handed to onnxruntime without a copy
(``_ort_session``), whose pages leave the process once the session has prepacked them.

File layout (little-endian)::

    b"MSKERNEL" | u32 version | u32 header bytes | 32-byte sha256 of the header | header (JSON) | pad to a page
    payload: per matrix, its codes, scales and bias (if any), each starting on a page

The header names the source files (size and mtime in ns, so an edited or replaced GGUF is noticed) and,
per matrix key, ``n, k, bits, block`` and each part's offset, dtype and shape.  A file that is short,
from another version, whose header does not hash to its digest, or made from other source bytes is
rebuilt (a warning says why); a directory we cannot write to leaves repacking in memory at first use,
as before.  The payload is as trusted as the GGUF beside it: neither carries a checksum of its data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from ._qkernels import Format, Packed

Format_ = tuple[int, int, Format]  # (n, k, the stored format's kernel layout)

log = logging.getLogger(__name__)

MAGIC = b"MSKERNEL"
VERSION = 1
SUFFIX = ".kernels"
_PREFIX = struct.Struct("<8sII32s")  # magic, version, header bytes, sha256(header)


class StaleKernels(Exception):
    """Why an existing kernel file cannot be used (said in the rebuild warning)."""


def kernel_path(gguf: str | os.PathLike[str]) -> Path:
    return Path(str(gguf) + SUFFIX)


def _sources(paths: Iterable[str]) -> list[dict[str, object]]:
    return [{"name": Path(p).name, "size": os.stat(p).st_size, "mtime_ns": os.stat(p).st_mtime_ns} for p in paths]


def _page(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _layout(shapes: dict[str, Format_]) -> tuple[dict[str, dict[str, object]], int]:
    """Each key's entry (``n, k, bits, block`` and its parts' offsets, dtypes, shapes) and the payload bytes."""
    entries: dict[str, dict[str, object]] = {}
    at = 0
    for key, (n, k, fmt) in shapes.items():
        blocks = k // fmt.block
        parts = {"data": ("|u1", [n, blocks, fmt.block * fmt.bits // 8]), "scales": ("<f4", [n, blocks])}
        if fmt.bias:
            parts["bias"] = ("<f4", [n, blocks])
        e: dict[str, object] = {"n": n, "k": k, "bits": fmt.bits, "block": fmt.block}
        for name, (dtype, shape) in parts.items():
            e[name] = [at, dtype, shape]
            at = _page(at + int(np.prod(shape)) * np.dtype(dtype).itemsize)
        entries[key] = e
    return entries, at


def write(path: Path, sources: list[dict[str, object]], shapes: dict[str, Format_],
          repack: Callable[[str], Packed]) -> None:
    """Repack every key of ``shapes`` (``(n, k, format)`` each) into ``path``, one matrix in memory at a time,
    atomically (a temporary file renamed over it)."""
    entries, payload = _layout(shapes)
    header = json.dumps({"sources": sources, "payload_bytes": payload, "entries": entries}).encode()
    start = _page(_PREFIX.size + len(header))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, VERSION, len(header), hashlib.sha256(header).digest()) + header)
            for key, e in entries.items():
                p = repack(key)
                for name in ("data", "scales", "bias"):
                    if name not in e:
                        continue
                    at, dtype, shape = e[name]  # type: ignore[misc]
                    a = getattr(p, name)
                    if a is None or list(a.shape) != shape or a.dtype != np.dtype(dtype):
                        raise ValueError(f"{key}: repacked {name} is not {dtype} {shape}")
                    f.seek(start + at)
                    f.write(np.ascontiguousarray(a).tobytes())
            f.truncate(start + payload)  # each part at its page; the gaps read back as zeros
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class KernelFile:
    """A mapped kernel file: ``packed(key)`` is a ``Packed`` whose arrays are views of the file."""

    def __init__(self, path: Path, sources: list[dict[str, object]]) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._entries, self._start = self._read_header(sources)
        except StaleKernels:
            self._map.close()
            raise

    def _read_header(self, sources: list[dict[str, object]]) -> tuple[dict[str, dict], int]:  # type: ignore[type-arg]
        m = self._map
        if len(m) < _PREFIX.size:
            raise StaleKernels(f"{len(m)} bytes, shorter than its prefix")
        magic, version, size, digest = _PREFIX.unpack_from(m, 0)
        if magic != MAGIC:
            raise StaleKernels("not a moeswarm kernel file (bad magic)")
        if version != VERSION:
            raise StaleKernels(f"format version {version}, this moeswarm writes {VERSION}")
        header = bytes(m[_PREFIX.size: _PREFIX.size + size])
        if len(header) != size or hashlib.sha256(header).digest() != digest:
            raise StaleKernels("its header does not match its digest (cut short or corrupt)")
        meta = json.loads(header)
        if meta["sources"] != sources:
            raise StaleKernels("made from other source bytes (the GGUF changed since)")
        start = _page(_PREFIX.size + size)
        if len(m) != start + int(meta["payload_bytes"]):
            raise StaleKernels(f"{len(m)} bytes where its header says {start + int(meta['payload_bytes'])}")
        return meta["entries"], start

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def packed(self, key: str) -> Packed:
        e = self._entries[key]

        def part(name: str) -> np.ndarray | None:
            if name not in e:
                return None
            at, dtype, shape = e[name]
            return np.ndarray(tuple(shape), np.dtype(dtype), self._map, self._start + at)

        return Packed(e["n"], e["k"], e["bits"], e["block"], part("data"), part("scales"), part("bias"))  # type: ignore[arg-type]


BUILDS = {"count": 0}  # kernel files written by this process (tests assert a second process writes none)


def open_or_build(gguf_paths: list[str], shapes: dict[str, Format_],
                  repack: Callable[[str], Packed]) -> KernelFile | None:
    """The kernel file beside ``gguf_paths[0]`` holding every key of ``shapes``, built (``repack(key)`` each) if it is
    missing, stale or corrupt; None where it can be neither read nor written (repacking stays per use)."""
    path = kernel_path(gguf_paths[0])
    sources = _sources(gguf_paths)
    if path.exists():
        try:
            kf = KernelFile(path, sources)
            if all(k in kf for k in shapes):
                return kf
            raise StaleKernels(f"lacks {sum(k not in kf for k in shapes)} of the {len(shapes)} matrices")
        except (StaleKernels, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("rebuilding the kernel file %s: %s", path, e)
    try:
        write(path, sources, shapes, repack)
        BUILDS["count"] += 1
        return KernelFile(path, sources)
    except (OSError, StaleKernels) as e:
        log.warning("no kernel file beside %s (%s): quantized matrices are repacked in memory at first use",
                    gguf_paths[0], e)
        return None
