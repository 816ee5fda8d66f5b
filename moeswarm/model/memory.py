"""Serving a checkpoint larger than the memory it may use: demand paging under a budget.

The checkpoint is memory-mapped, so the kernel's demand paging is the loader.  This module
steers it:

* ``MADV_RANDOM`` on every mapping, so reading one expert does not pull its neighbours in
  (default readahead over-reads ~2.9x on this kind of VM);
* before a MoE layer runs, the experts its router picked (and, one layer ahead, the ones the
  next router is predicted to pick) are read into the page cache by a background thread with
  ``pread`` of exactly their byte ranges: on a ``MADV_RANDOM`` mapping ``MADV_WILLNEED`` does not
  help (measured on this VM: 90-100 MB/s, page by page, vs 870-1,400 MB/s for the same range
  read with ``pread``); an expert's compute waits for its own read only;
* if the resident set plus what an expert needs would pass the budget, the least recently used
  other experts are dropped: ``MADV_DONTNEED`` on their pages (RSS falls at once) and
  ``POSIX_FADV_DONTNEED`` on their file range (the page cache forgets them too);
* ``MemoryStats`` reads the seed's figures: VmSize, VmRSS, VmSwap, major/minor page faults and
  bytes read from disk, per token.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import resource
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.array_utils import byte_bounds

from ..errors import ConfigError
from .expert_cache import CacheStats, RecencyFrequency, predict_next_experts
from .weights import ExpertWeights, Weights

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"8GB"``, ``"512MiB"``, ``"1.5g"``, ``"1.5e9"`` -> bytes (GB = 10^9, GiB = 2^30, a bare
    unit letter binary, as Docker's and Java's ``8g``).  Every command's size options read this."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text, re.IGNORECASE)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a size: {text!r} (e.g. 8GB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_bytes() -> int:
    """Memory the kernel says a new workload can take without swapping (``MemAvailable``); 0 where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _status() -> dict[str, int]:
    """/proc/self/status memory fields, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmSize", "VmRSS", "VmSwap", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _read_bytes() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class MemoryStats:
    """Counters at one moment; ``delta`` of two gives the figures for the span between."""

    vm_size: int
    vm_rss: int
    vm_swap: int
    major_faults: int
    minor_faults: int
    disk_read: int
    rss_anon: int = 0  # of vm_rss: private memory (kernels, copies, caches)
    rss_file: int = 0  # of vm_rss: mapped file pages (the checkpoint's, the libraries')

    @classmethod
    def now(cls) -> "MemoryStats":
        s, ru = _status(), resource.getrusage(resource.RUSAGE_SELF)
        return cls(s.get("VmSize", 0), s.get("VmRSS", 0), s.get("VmSwap", 0), ru.ru_majflt, ru.ru_minflt, _read_bytes(),
                   s.get("RssAnon", 0), s.get("RssFile", 0))

    def report(self, since: "MemoryStats", tokens: int, seconds: float) -> str:
        n = max(tokens, 1)
        return (f"VmSize {self.vm_size / 2**30:.2f} GiB, VmRSS {self.vm_rss / 2**20:.0f} MiB (anon "
                f"{self.rss_anon / 2**20:.0f}, file {self.rss_file / 2**20:.0f}; {since.vm_rss / 2**20:.0f} MiB before "
                f"loading), VmSwap {self.vm_swap / 2**20:.0f} MiB; per token: "
                f"{(self.major_faults - since.major_faults) / n:.0f} major + "
                f"{(self.minor_faults - since.minor_faults) / n:.0f} minor faults, "
                f"{(self.disk_read - since.disk_read) / n / 2**20:.1f} MB read from disk; "
                f"{tokens / max(seconds, 1e-9):.2f} tokens/s")


def footprint(model) -> str:  # type: ignore[no-untyped-def]
    """What RSS should be made of: the weights' stored bytes, and the copies built from them (quantized
    kernels, as ``_qkernels.kernel_nbytes`` counts them, and float32 conversions of the backbone; the
    expert cache of kernels / float32 experts).  A stored tensor's mapped pages leave RSS once its kernel
    holds its values, so a quantized model decodes in about its kernels' bytes (~1.3x a Q8_0 file); F16/BF16
    matrices computed as stored (``_f16``) build nothing: an F16 file decodes in its stored bytes.
    ``generate --stats`` prints it beside VmRSS."""
    w = model.weights
    seen: set[int] = set()
    stored = backbone = 0
    for a in w.tensors.values():
        if id(a) in seen:
            continue
        seen.add(id(a))
        stored += int(a.nbytes)
        backbone += int(getattr(a, "kernel_nbytes", 0))
    backbone += sum(int(k.nbytes) for k in getattr(model, "fused", {}).values())  # q/k/v, MLPs in one call each
    stored += sum(x.nbytes for layer in w.experts.values() for x in layer.values())
    owner = getattr(model.experts, "cache", None)
    cache = getattr(owner, "_copies", None)
    experts = cache.bytes if cache is not None else 0
    as_stored = len(getattr(owner, "_as_stored", ()))
    return (f"weights stored {stored / 2**20:.0f} MiB; built from them: backbone kernels/copies "
            f"{backbone / 2**20:.0f} MiB, expert cache {experts / 2**20:.0f} MiB ({cache.experts if cache else 0} experts)"
            + (f"; {as_stored} F16/BF16 experts computed as stored" if as_stored else ""))


@dataclass(frozen=True)
class _Region:
    map: mmap.mmap  # the mapping the pages belong to
    fd_path: str  # the file, for posix_fadvise
    start: int  # page-aligned offset in the mapping / file
    length: int


def _mapping_of(a: np.ndarray) -> np.memmap | None:
    base = a
    while base is not None and not isinstance(base, np.memmap):
        base = base.base  # type: ignore[assignment]
    return base


_ORIGINS: dict[int, int] = {}


def _origin(mm: mmap.mmap) -> int:
    """Address of a mapping's first byte (our maps start at file offset 0)."""
    if id(mm) not in _ORIGINS:
        _ORIGINS[id(mm)] = int(byte_bounds(np.frombuffer(mm, dtype=np.uint8))[0])
    return _ORIGINS[id(mm)]


def _stored_arrays(a: object) -> list[np.ndarray]:
    """The arrays that hold a tensor's bytes: a GGUF-quantised tensor's blocks, a published-format
    tensor's codes and scales (``_stored.StoredTensor``), else the array itself."""
    if hasattr(a, "arrays"):
        return list(a.arrays())  # type: ignore[attr-defined]
    return [getattr(a, "raw", a)]


def _regions(w: ExpertWeights) -> list[_Region]:
    """The page-aligned file ranges holding an expert's tensors (empty for in-memory arrays)."""
    page = mmap.PAGESIZE
    spans: list[tuple[int, int, np.memmap, mmap.mmap]] = []  # exact byte bounds in the mapping
    for a in (b for t in w.arrays() for b in _stored_arrays(t)):
        mapped = _mapping_of(a)
        mm = getattr(mapped, "_mmap", None)
        if mapped is None or mm is None or getattr(mapped, "offset", 0):
            continue
        low, high = byte_bounds(a)
        spans.append((low - _origin(mm), high - _origin(mm), mapped, mm))
    out = []
    for low, high, mapped, mm in _merged(spans):
        start = low // page * page
        end = min(-(-high // page) * page, len(mm))
        out.append(_Region(mm, str(mapped.filename), start, end - start))
    return out


def _merged(spans: list[tuple[int, int, Any, mmap.mmap]]) -> list[tuple[int, int, Any, mmap.mmap]]:
    """Byte ranges of one mapping that overlap, as one: an MXFP4 expert's gate and up are every
    other row of one stored tensor, so their bounds coincide; their bytes count once."""
    out: list[tuple[int, int, Any, mmap.mmap]] = []
    for span in sorted(spans, key=lambda s: (id(s[3]), s[0])):
        if out and out[-1][3] is span[3] and span[0] < out[-1][1]:
            last = out[-1]
            out[-1] = (last[0], max(last[1], span[1]), last[2], last[3])
        else:
            out.append(span)
    return out


def expert_ranges(w: ExpertWeights) -> list[tuple[str, int, int]]:
    """(file, offset, length) of the page-aligned ranges holding an expert in its checkpoint."""
    return [(r.fd_path, r.start, r.length) for r in _regions(w)]


def read_range(fd: int, start: int, length: int, buffer: bytearray) -> int:
    """``pread`` the file range into the page cache, ``buffer`` at a time (its contents are
    thrown away); returns the bytes read (fewer at end of file)."""
    view, done = memoryview(buffer), 0
    while done < length:
        n = os.preadv(fd, [view[: min(len(view), length - done)]], start + done)
        if n <= 0:
            break
        done += n
    return done


_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(w: ExpertWeights) -> float:
    """Share of an expert's mapped pages in RAM now (``mincore``: the page cache, whether or not
    this process touched them).  Arrays not backed by a file count as resident."""
    resident = total = 0
    for r in _regions(w):
        pages = r.length // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(_origin(r.map) + r.start), ctypes.c_size_t(r.length), vec) != 0:
            continue  # not a mapping we can ask about: leave it out
        resident += int((np.frombuffer(vec, np.uint8) & 1).sum())
        total += pages
    return resident / total if total else 1.0


class MemoryBudget:
    """Keeps the process's resident set under ``budget_bytes`` while the model runs.

    Attach with ``budget.attach(model)``: it observes every MoE layer's routing (prefetch and
    eviction) before the experts run.
    """

    def __init__(self, weights: Weights, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.regions = {(L, e): _regions(w) for L, layer in weights.experts.items() for e, w in layer.items()}
        self.sizes = {key: sum(r.length for r in regions) for key, regions in self.regions.items()}
        # what is resident and in which order to evict it: weakest recency x frequency score first
        # (a computed expert's pages are resident whatever a policy thinks: no admission bypass)
        self.resident = RecencyFrequency(capacity=len(self.sizes) + 1, bypass=False)
        self.stats = CacheStats()
        self.evictions = 0
        self._predicted: dict[int, set[int]] = {}  # layer -> experts predicted for it
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="moeswarm-prefetch")
        self._reading: dict[tuple[int, int], Future[None]] = {}
        self._buffer = bytearray(4 << 20)  # pread target, reused (only the page cache is the point)
        maps = {id(r.map): r.map for regions in self.regions.values() for r in regions}
        for m in maps.values():
            m.madvise(mmap.MADV_RANDOM)
        # The backbone (attention, norms, router, embeddings, LM head) stays resident: fault it in
        # now, so every later RSS reading already includes it and only experts come and go.
        for a in (b for t in weights.tensors.values() for b in _stored_arrays(t)):
            flat = np.asarray(a).reshape(-1)
            if flat.size:
                float(flat[:: max(1, mmap.PAGESIZE // flat.itemsize)].astype(np.float32).sum())
        baseline = MemoryStats.now().vm_rss
        largest = max(self.sizes.values(), default=0)
        if baseline + largest > budget_bytes:
            raise ConfigError(f"--memory-budget {budget_bytes / 2**20:.0f} MiB is below what the process already "
                              f"uses with the backbone weights ({baseline / 2**20:.0f} MiB) plus one expert "
                              f"({largest / 2**20:.0f} MiB)")

    def attach(self, model) -> None:  # type: ignore[no-untyped-def]
        """Prefetch predicted and routed experts; make room before each expert is computed."""
        self.model = model
        model.observers.append(self.before_layer)
        model.state_observers.append(self.predict)
        if hasattr(model.experts, "on_access"):
            model.experts.on_access = self.before_expert

    def _fd(self, path: str) -> int:
        with self._fd_lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def _read(self, key: tuple[int, int]) -> None:
        """Prefetch thread: bring an expert's byte ranges into the page cache (not into RSS)."""
        for r in self.regions.get(key, ()):
            read_range(self._fd(r.fd_path), r.start, r.length, self._buffer)

    def _willneed(self, layer: int, experts: Iterable[int]) -> None:
        for e in experts:
            key = (layer, int(e))
            if key in self.resident or key in self._reading:
                continue
            self._reading[key] = self._reader.submit(self._read, key)

    def predict(self, layer: int, x: np.ndarray) -> None:
        """Before layer ``layer``'s MLP: guess the next MoE layer's experts and start reading them."""
        if not self.model.config.moe_layers[layer]:
            return
        ids = predict_next_experts(self.model.config, self.model.weights, layer, x)
        if ids is not None:
            nxt = next(L for L in range(layer + 1, self.model.config.num_layers) if self.model.config.moe_layers[L])
            self._predicted[nxt] = set(np.unique(ids).tolist())
            self._willneed(nxt, self._predicted[nxt])

    def before_layer(self, layer: int, ids: np.ndarray) -> None:
        """The router has chosen: read those experts into the page cache now (not into RSS)."""
        chosen = set(np.unique(ids).tolist())
        guess = self._predicted.pop(layer, None)
        if guess is not None:
            self.stats.picks += len(chosen)
            self.stats.predicted += len(chosen & guess)
        for key in [k for k in self._reading if k[0] == layer and k[1] not in chosen]:
            del self._reading[key]  # predicted, not picked: forget it (a later pick reads it afresh)
        self._willneed(layer, chosen - (guess or set()))

    def before_expert(self, layer: int, expert: int) -> None:
        """Evict the weakest experts (recency x frequency) until this one's pages fit the budget."""
        key = (layer, expert)
        reading = self._reading.pop(key, None)
        hit = key in self.resident
        if reading is not None:
            reading.result()  # its read, started when the router (or the prediction) picked it
        elif not hit:
            self._read(key)  # nobody prefetched it (an expert server): one pread beats page-by-page faults
        need = 0 if hit else self.sizes.get(key, 0)
        self.stats.hits += hit
        self.stats.misses += not hit
        self.stats.bytes_fetched += need
        rss = _status().get("VmRSS", 0)
        while rss + need > self.budget:
            victim = self.resident.evict_one(protect=key)
            if victim is None:
                break
            rss -= self.evict(victim)  # type: ignore[arg-type]
        self.resident.access(key)

    def evict(self, key: tuple[int, int]) -> int:
        """Drop an expert's pages from this process and from the page cache; returns its bytes."""
        for r in self.regions.get(key, ()):
            r.map.madvise(mmap.MADV_DONTNEED, r.start, r.length)
            os.posix_fadvise(self._fd(r.fd_path), r.start, r.length, os.POSIX_FADV_DONTNEED)
        self.evictions += 1
        return self.sizes.get(key, 0)

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._reading.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
