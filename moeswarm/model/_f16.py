"""F16 / BF16 weights computed as stored: ``x @ w.T`` read from the 2-byte weights, no float32 copy.

``StoredLinear`` wraps a ``(out, in)`` matrix of IEEE halves (GGUF F16, fp16 safetensors) or bfloat16 (GGUF BF16,
bf16 safetensors), usually a view into the memory-mapped file, and computes products with ``_f16c`` (C, built at
``pip install`` from ``_f16c.c``): each weight is converted in a register (F16C / a shift for bfloat16) and summed
in float32 by fused multiply-adds, AVX-512F or AVX2, picked at run time.  A product streams the stored bytes (half
of what a float32 copy streams) and resident memory is those bytes, once.

Measured against the float32 copies it replaces (docs/engine.md; 16 matrices of 2816 x 1024 cycled, one thread):
no memory beyond the stored bytes (a float32 copy is 2x them; onnxruntime with the Cast kept holds 2.9x, OpenVINO's
CPU plugin 4.3x), a gemv in 0.75-0.8x the time of numpy's sgemv on the float32 copy, 64 rows in 0.68x.

Where the kernel cannot serve (no compiler at install, a CPU without AVX2 + F16C + FMA, a matrix whose columns
are reordered after decoding), ``stored_linear`` returns None and the caller keeps its float32 path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._ort_session import threads

try:
    from ._f16c import isa as _isa  # type: ignore[import-not-found]
    from ._f16c import matmul as kernel_matmul  # type: ignore[import-not-found]
except ImportError:  # not compiled (no C compiler at install): float32 copies, as before
    _isa = kernel_matmul = None

ISA: int = _isa() if _isa is not None else 0  # 2 AVX-512F, 1 AVX2 + F16C + FMA, 0 none (no kernel)
PARALLEL_MIN = 1 << 20  # weights x rows of x from which a product is split over the kernels' threads


def available() -> bool:
    """Whether F16 / BF16 matrices are computed as stored in this process."""
    return ISA > 0


def is_bf16(dtype: Any) -> bool | None:
    """True for bfloat16, False for IEEE half, None for any other element type."""
    if dtype == np.float16:
        return False
    return True if getattr(dtype, "name", "") == "bfloat16" else None


class StoredLinear:
    """``x (..., in) @ w.T -> (..., out)`` float32 for ``w (out, in)`` F16 or BF16, read as stored.

    ``nbytes`` is the stored bytes: all this holds (a view), and what a product reads."""

    __slots__ = ("bf16", "isa", "rows", "w")

    def __init__(self, w: np.ndarray, bf16: bool, rows: np.ndarray | None = None, isa: int | None = None) -> None:
        if w.ndim != 2 or w.itemsize != 2 or not w.flags.c_contiguous:
            raise ValueError(f"StoredLinear needs a C-contiguous (out, in) matrix of 2-byte elements, not {w.dtype} "
                             f"{w.shape}")
        self.w = w.view(np.uint16)  # (out, in) the stored bytes, not copied
        self.bf16 = bool(bf16)
        self.rows = rows  # (out,) the logical row i is stored row rows[i] (llama.cpp's rotary order), or None
        self.isa = ISA if isa is None else isa  # tests pick AVX2 on an AVX-512 CPU

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return int(self.w.nbytes)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        out, n = self.w.shape
        x = np.asarray(x, np.float32)
        if x.shape[-1] != n:
            raise ValueError(f"input of {x.shape[-1]} features for a ({out}, {n}) matrix")
        flat = np.ascontiguousarray(x.reshape(-1, n))  # (M, in)
        m = flat.shape[0]
        y = np.empty((m, out), np.float32)  # (M, out)
        parts = threads() if out * n * max(m, 1) >= PARALLEL_MIN else 1
        kernel_matmul(flat, self.w, y, m, n, out, self.isa, self.bf16, parts)
        if self.rows is not None:
            y = y[:, self.rows]
        return y.reshape(*x.shape[:-1], out)

    def __repr__(self) -> str:
        return f"StoredLinear({'BF16' if self.bf16 else 'F16'}, shape={self.shape})"


def stored_linear(a: Any) -> StoredLinear | None:
    """A ``StoredLinear`` over ``a`` (a 2-D float16 / bfloat16 array, as stored), or None where the kernel cannot
    compute it (not built, not this CPU, another dtype or layout)."""
    if not available() or not isinstance(a, np.ndarray) or a.ndim != 2 or not a.flags.c_contiguous:
        return None
    bf16 = is_bf16(a.dtype)
    return None if bf16 is None else StoredLinear(a, bf16)
