"""onnxruntime sessions for the quantized kernels, with their weights handed over rather than serialized.

Why: a graph whose weights are serialized into the model bytes holds them three times for its whole
life: onnxruntime deserializes each initializer into one planned buffer, the kernel prepacks it into its
own layout, and erasing the prepacked initializer (onnxruntime does, in
``PrepackConstantInitializedTensors``) does not free that buffer.  Measured on a Q8_0 expert graph: 20.1
MiB resident for 6.2 MiB of packed weights; a 358 MiB Q8_0 GGUF decoded at ~980 MiB RSS.

How: each weight is declared in the graph as an external-data placeholder and given to the session with
``SessionOptions.add_external_initializers``: ``OrtValue``s over our own buffer, no copy.  Creating the
session prepacks them (``MatMulNBits`` packs its quantized ``B`` and scales into the MLAS layout, ``MatMul``
packs a constant float ``B``) and onnxruntime stops reading the originals.  The buffer is a private
anonymous mapping: once the session exists its pages go back to the kernel (``MADV_DONTNEED``) while the
mapping stays for the session's life, so nothing can read freed memory (a read sees zeros).  A probe run
before and after checks the outputs did not change; where they do (a CPU or onnxruntime version whose
kernel reads the original weights at run time), the buffer is filled again and kept resident.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

_THREADS = {"intra": 0}  # 0: onnxruntime's default (one per physical core)
_lock = threading.Lock()
_env_ready = False
_PLACEHOLDER = "moeswarm-weights-in-memory"  # the external-data location of a handed-over weight (never a file)
# What one session holds besides its weights' prepacked copy (graph, kernels, plans, arena pages), counted with
# each kernel: measured 0.16 MiB for an expert graph of 32 x 32 matrices, 0.1 MiB for a one-matrix graph.
SESSION_NBYTES = 200 << 10


def set_threads(n: int) -> None:
    """Threads of the kernels' shared pool; takes effect if called before the first kernel is built."""
    _THREADS["intra"] = max(0, int(n))


def threads() -> int:
    """The kernels' threads: as set, else one per physical core (onnxruntime's default; the F16 kernel's too)."""
    if _THREADS["intra"]:
        return _THREADS["intra"]
    import psutil

    return int(psutil.cpu_count(logical=False) or 1)


def global_pool_active() -> bool:
    """Whether this process's onnxruntime runs on the kernels' global thread pool: once it does,
    every other session in the process (e.g. a bridge's ONNX shards) must use it too."""
    return _env_ready is True


def placeholder(name: str, a: np.ndarray):  # type: ignore[no-untyped-def]
    """A TensorProto declaring ``a``'s name, type and shape, its data supplied by ``add_external_initializers``."""
    from onnx import TensorProto, helper

    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(a.dtype), dims=a.shape,
                    data_location=TensorProto.EXTERNAL)
    t.external_data.add(key="location", value=_PLACEHOLDER)
    return t


@dataclass(frozen=True)
class Lazy:
    """A weight written straight into the session's buffer by ``fill(out)`` (e.g. a stack of many experts'
    matrices), so that no whole copy of it exists beside the buffer; ``fill`` may be called again."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fill: Callable[[np.ndarray], None]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


class WeightBuffer:
    """A graph's weights as OrtValues: views of a read-only file mapping (a kernel file, ``_kernel_file``) are
    handed over as they are; anything else is copied into one private anonymous mapping (each page-aligned)."""

    def __init__(self, arrays: list[tuple[str, np.ndarray | Lazy]]) -> None:
        page = mmap.PAGESIZE
        self.names = [name for name, _ in arrays]
        self.mapped = [isinstance(a, np.ndarray) and _file_mapping(a) is not None for _, a in arrays]  # not copied
        sizes = [0 if m else -(-a.nbytes // page) * page for (_, a), m in zip(arrays, self.mapped)]
        self.map = mmap.mmap(-1, max(sum(sizes), page), flags=mmap.MAP_PRIVATE)
        self.views: list[np.ndarray] = []
        at = 0
        for (_, a), size, m in zip(arrays, sizes, self.mapped):
            self.views.append(a if m else np.frombuffer(self.map, a.dtype, a.size, at).reshape(a.shape))
            at += size
        self.fill([a for _, a in arrays])
        self.resident = True  # whether the copies hold pages (False once released)

    def fill(self, arrays: list[np.ndarray | Lazy]) -> None:
        for view, a, m in zip(self.views, arrays, self.mapped):
            if isinstance(a, Lazy):
                a.fill(view)
            elif not m:
                view[...] = a
        self.resident = True

    def values(self) -> list:  # type: ignore[type-arg]
        import onnxruntime as ort

        return [ort.OrtValue.ortvalue_from_numpy(v) for v in self.views]

    def release(self) -> None:
        """Give the pages back: the copies' (the mapping stays: a later read sees zeros, never freed memory) and
        the file-backed views' (a later read faults them back from the file)."""
        self.map.madvise(mmap.MADV_DONTNEED)
        for view, m in zip(self.views, self.mapped):
            if m:
                release_mapped(view)
        self.resident = False

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v, m in zip(self.views, self.mapped) if not m) if self.resident else 0


def _file_mapping(a: np.ndarray) -> mmap.mmap | None:
    """The read-only ``mmap`` ``a`` is a contiguous view of, or None."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base  # type: ignore[assignment]
    if isinstance(base, mmap.mmap) and a.flags.c_contiguous and not a.flags.writeable:
        return base
    return None


def release_mapped(a: np.ndarray) -> None:
    """Drop ``a``'s whole pages from this process if it is a view of a read-only file mapping (a later read
    faults them back from the file)."""
    m = _file_mapping(a)
    if m is None or a.nbytes == 0:
        return
    origin = np.frombuffer(m, np.uint8).__array_interface__["data"][0]
    low = a.__array_interface__["data"][0] - origin
    start, end = -(-low // mmap.PAGESIZE) * mmap.PAGESIZE, (low + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        m.madvise(mmap.MADV_DONTNEED, start, end - start)


class Session:
    """An onnxruntime session computing ``Y`` from float32 inputs, and the buffer of its weights."""

    def __init__(self, model_bytes: bytes, inputs: dict[str, int], weights: list[tuple[str, np.ndarray | Lazy]]) -> None:
        self.weights = WeightBuffer(weights)
        self.session = _session(model_bytes, self.weights)
        if weights:
            self._release(inputs, weights)

    def run(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        return self.session.run(("Y",), {"X": x})[0]

    def run_inputs(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """``Y`` from several float32 inputs by name."""
        return self.session.run(("Y",), {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in feeds.items()})[0]

    def _release(self, inputs: dict[str, int], weights: list[tuple[str, np.ndarray | Lazy]]) -> None:
        probe = {name: np.random.default_rng(0).standard_normal((1, k), dtype=np.float32) for name, k in inputs.items()}
        before = self.session.run(("Y",), probe)[0]
        self.weights.release()
        if not np.array_equal(self.session.run(("Y",), probe)[0], before, equal_nan=True):
            self.weights.fill([a for _, a in weights])  # this build of onnxruntime reads them at run time


def _session(model_bytes: bytes, weights: WeightBuffer):  # type: ignore[no-untyped-def]
    global _env_ready
    import onnxruntime as ort

    with _lock:
        so = ort.SessionOptions()
        if not _env_ready:
            try:  # one thread pool for all kernels (a session each would start its own)
                ort.capi._pybind_state.set_global_thread_pool_sizes(_THREADS["intra"], 1)
                _env_ready = True
            except RuntimeError:
                _env_ready = None  # type: ignore[assignment]  # the environment exists already
        if _env_ready:
            so.use_per_session_threads = False
        else:
            so.intra_op_num_threads = _THREADS["intra"]
        so.log_severity_level = 3
        if weights.names:
            so.add_external_initializers(weights.names, weights.values())
        session = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
        _trim()  # the graph's serialized copies are freed now: give their pages back
        return session


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
