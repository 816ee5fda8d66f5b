"""``QuantizedTensor``: a weight kept in its GGML encoding inside the file's memory map.

The engine turns every weight into float32 at use through ``experts.f32`` (``a.astype(float32)``
unless ``a.dtype`` is already float32).  A ``QuantizedTensor`` fits that protocol: ``dtype`` is
the storage element (``uint8``: GGML blocks are bytes), ``shape`` the logical shape,
``nbytes`` the encoded size, and ``astype(np.float32)`` dequantises with
``gguf.quants.dequantize`` straight from the mapped bytes.  Nothing is read before that call.

One expert of a stacked ``[E, rows, cols]`` tensor owns a contiguous byte range (GGML blocks run
along the innermost axis), so its ``QuantizedTensor`` is a view of just those bytes: the kernel
pages in that expert and nothing else.

It also carries llama.cpp's rotary row permutation of ``attn_q`` / ``attn_k`` (``rows``), undone
after dequantising; that is why an F16/F32 tensor can be a ``QuantizedTensor`` too.

Computing: ``matmul(x)`` (what ``experts.mm`` calls) runs the repacked kernel of ``_qkernels`` for the
types it has (``kernel_format``), built once on first use; F16/BF16 matrices are computed from their stored bytes by
``_f16.StoredLinear`` (no copy; the row order is applied to the output); other types (F32 with a row order, K-quants
without a kernel, F16 where the F16 kernel is not built or a column order applies) are decoded to float32 once and
kept.  ``packed()`` is the repacked form.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from ._f16 import StoredLinear
from ._f16 import available as f16_kernel_available
from ._pages import release_pages
from ._qkernels import REPACKERS, Packed, QLinear, repack


class QuantizedTensor:
    """A GGML-encoded tensor (or one expert's slice of a stacked one), decoded on demand."""

    __slots__ = ("raw", "qtype", "shape", "rows", "cols", "_kernel", "_kernel_file", "_key")

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                 rows: np.ndarray | None = None, cols: np.ndarray | None = None) -> None:
        self.raw = np.asarray(raw).view(np.uint8)  # (..., bytes per row): the encoded blocks, a plain view of the map
        self.qtype = qtype
        self.shape = tuple(int(d) for d in shape)  # logical shape, e.g. (I, H)
        self.rows = rows  # (shape[0],) row order to apply after decoding, or None
        self.cols = cols  # (shape[1],) column order to apply after decoding, or None (Qwen3.5 ssm_out)
        self._kernel: Any = None  # QLinear, or the decoded float32 matrix, once matmul has run
        self._kernel_file: Any = None  # a _kernel_file.KernelFile holding this matrix repacked, or None
        self._key = ""  # this matrix's key in it

    @property
    def kernel_format(self) -> str | None:
        """The ``_qkernels.REPACKERS`` key this tensor's matrix product runs on, or None."""
        return (self.qtype.name if self.ndim == 2 and self.cols is None and self.qtype.name in REPACKERS
                else None)  # reordered columns (Qwen3.5 ssm_out) are decoded once instead

    def packed(self) -> Packed:
        """The matrix in the kernels' layout: views of the kernel file beside the GGUF when there is one
        (``_kernel_file``), else repacked from the stored blocks now (a new copy)."""
        if self._kernel_file is not None:
            return self._kernel_file.packed(self._key)  # type: ignore[no-any-return]
        return self.repacked()

    def repacked(self) -> Packed:
        """The matrix repacked from its stored blocks (numpy, ~10-20 ms for a Mixtral-sized expert)."""
        p = repack(self.raw, self.qtype.name, self.shape)  # type: ignore[arg-type]
        return p if self.rows is None else p.take_rows(self.rows)

    def use_kernel_file(self, kernel_file: Any, key: str) -> None:
        """Take ``packed()`` from ``kernel_file`` (a ``KernelFile`` holding ``key``) from now on."""
        self._kernel_file, self._key = kernel_file, key

    def prepare(self) -> None:
        """Build what ``matmul`` computes with (the repacked kernel, the F16 kernel over the stored bytes, else a
        float32 copy), once."""
        if self._kernel is None:
            self._kernel = self.stored_linear()
            if self._kernel is not None:
                return  # it reads the mapped bytes: they stay
            self._kernel = QLinear(self.packed()) if self.kernel_format else self.astype(np.float32)
            self.release_pages()

    def stored_linear(self) -> StoredLinear | None:
        """This F16/BF16 matrix computed from its stored bytes (``_f16``), or None (another type, a column order,
        or no F16 kernel in this process)."""
        if self.qtype.name not in ("F16", "BF16") or self.ndim != 2 or self.cols is not None or not f16_kernel_available():
            return None
        return StoredLinear(self.raw.view(np.uint16).reshape(self.shape), self.qtype.name == "BF16", self.rows)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """``x (M, in) @ self.T -> (M, out)`` float32 (the weight in ``nn.Linear`` orientation)."""
        self.prepare()
        if isinstance(self._kernel, np.ndarray):
            return np.asarray(x, np.float32) @ self._kernel.T
        return self._kernel.matmul(x)

    @property
    def dtype(self) -> np.dtype:
        """The storage element: bytes.  Never float32, so ``f32()`` always calls ``astype``."""
        return np.dtype(np.uint8)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Encoded bytes (what the expert costs in RAM, on disk and on the wire)."""
        return int(self.raw.nbytes)

    @property
    def bits_per_weight(self) -> float:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return 8.0 * size / block

    def astype(self, dtype: Any, copy: bool = True) -> np.ndarray:
        """Decode to a new array of ``dtype`` (float32 for the engine)."""
        out = dequantize(self.raw, self.qtype).reshape(self.shape)  # float32
        if self.rows is not None:
            out = out[self.rows]
        if self.cols is not None:
            out = out[:, self.cols]
        return out.astype(dtype, copy=False)

    @property
    def kernel_nbytes(self) -> int:
        """Bytes of the kernel (or float32 copy) built by ``matmul``; 0 before, and for the F16 kernel (no copy)."""
        return 0 if self._kernel is None or isinstance(self._kernel, StoredLinear) else int(self._kernel.nbytes)

    def release_pages(self) -> None:
        """Drop this tensor's mapped pages from the process once a kernel holds its values (``_pages``)."""
        release_pages(self.raw)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy is False:
            raise ValueError("a QuantizedTensor cannot be viewed as an array without decoding it")
        return self.astype(np.float32 if dtype is None else dtype)

    def __getitem__(self, index: Any) -> np.ndarray:
        """Rows by integer index (embedding lookups) decode only those rows; anything else decodes all."""
        if self.rows is None and self.cols is None and self.ndim == 2 and _is_int_index(index):
            idx = np.asarray(index)
            rows = self.raw.reshape(self.shape[0], -1)[idx.reshape(-1)]  # (n, bytes per row)
            return dequantize(rows, self.qtype).reshape(*idx.shape, self.shape[1])
        return self.astype(np.float32)[index]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.qtype.name}, shape={self.shape}, nbytes={self.nbytes})"


def _is_int_index(index: Any) -> bool:
    if isinstance(index, (int, np.integer)):
        return True
    if isinstance(index, (list, np.ndarray)):
        return np.asarray(index).dtype.kind in "iu"
    return False
