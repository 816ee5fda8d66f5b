"""``_f16.StoredLinear``: F16 / BF16 matrix products read from the stored 2-byte weights (moeswarm/model/_f16c.c),
against float64 products of the same weights.  The weights convert to float32 exactly, so the only error is float32
summation: at most n x 2^-24 x (|x| @ |w|.T) for n terms (the classic bound of recursive summation, which the
kernel's blocked sums stay within)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from moeswarm.model import _f16
from moeswarm.model._f16 import StoredLinear

SHAPES = [(1, 8, 16), (3, 37, 50), (5, 64, 1024), (9, 130, 72), (2, 4, 7)]  # (rows of x, out, in): tails of 16 / 8 / 4


def within_float32_summation(y: np.ndarray, x: np.ndarray, w64: np.ndarray) -> bool:
    bound = x.shape[-1] * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w64).T) + 1e-30
    return bool((np.abs(y - x.astype(np.float64) @ w64.T) <= bound).all())


def test_this_cpu_runs_the_kernel() -> None:
    assert _f16.available(), ("moeswarm.model._f16c is not built (pip install compiles moeswarm/model/_f16c.c where a C "
                              "compiler and Python's headers are present: apt install gcc python3-dev), or this CPU "
                              "lacks AVX2 + F16C + FMA")


@pytest.mark.parametrize("isa", sorted({1, _f16.ISA}))
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_products_are_float32_sums_of_the_stored_weights(isa: int, dtype: type) -> None:
    rng = np.random.default_rng(0)
    for m, out, n in SHAPES:
        w = rng.standard_normal((out, n)).astype(dtype)
        x = rng.standard_normal((m, n)).astype(np.float32)
        kernel = StoredLinear(w, dtype != np.float16, isa=isa)
        assert np.shares_memory(kernel.w, w)  # the stored bytes, not a copy
        y = kernel.matmul(x)
        assert y.dtype == np.float32 and y.shape == (m, out)
        assert within_float32_summation(y, x, w.astype(np.float64)), (isa, dtype, m, out, n)
        # negative control: the same bytes read as the other 2-byte format are caught by the bound
        other = StoredLinear(w, dtype == np.float16, isa=isa).matmul(x)
        assert not within_float32_summation(other, x, w.astype(np.float64))


def test_row_order_input_shape_and_threads(monkeypatch) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((67, 40)).astype(np.float16)
    rows = rng.permutation(67)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    one = StoredLinear(w, False, rows).matmul(x)  # (2, 3, 67): logical row i is stored row rows[i]
    assert one.shape == (2, 3, 67)
    assert within_float32_summation(one.reshape(6, 67), x.reshape(6, 40), w.astype(np.float64)[rows])
    monkeypatch.setattr(_f16, "threads", lambda: 3)
    monkeypatch.setattr(_f16, "PARALLEL_MIN", 0)
    assert np.array_equal(StoredLinear(w, False, rows).matmul(x), one)  # rows split over threads: same sums


def test_misuse_is_refused() -> None:
    w = np.zeros((4, 8), np.float16)
    with pytest.raises(ValueError, match="features"):
        StoredLinear(w, False).matmul(np.zeros((1, 9), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        StoredLinear(np.zeros((8, 4), np.float16).T, False)
    with pytest.raises(ValueError, match="2-byte"):
        StoredLinear(np.zeros((4, 8), np.float32), False)
    with pytest.raises(ValueError, match="buffer sizes"):  # the C side checks sizes itself
        _f16.kernel_matmul(np.zeros((1, 8), np.float32), w[:2], np.zeros((1, 4), np.float32), 1, 8, 4, 1, False, 1)
    with pytest.raises(ValueError, match="instruction set"):
        _f16.kernel_matmul(np.zeros((1, 8), np.float32), w, np.zeros((1, 4), np.float32), 1, 8, 4, 3, False, 1)


def test_a_forked_child_computes_the_same_products(monkeypatch) -> None:
    """A child forked from a process whose products ran on helper threads computes the same products (helper threads
    are started per product, so the child starts its own), bounded in time."""
    import os
    import select
    import signal

    rng = np.random.default_rng(2)
    w = rng.standard_normal((300, 64)).astype(np.float16)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    monkeypatch.setattr(_f16, "threads", lambda: 3)
    monkeypatch.setattr(_f16, "PARALLEL_MIN", 0)
    kernel = StoredLinear(w, False)
    expected = kernel.matmul(x)  # the parent's helpers exist from here on
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: same products, its result through the pipe
        try:
            os.write(write, b"".join(kernel.matmul(x).tobytes() for _ in range(20)))
        finally:
            os._exit(0)
    os.close(write)
    try:
        got = b""
        while len(got) < 20 * expected.nbytes and select.select([read], [], [], 30)[0]:
            chunk = os.read(read, 1 << 16)
            if not chunk:
                break
            got += chunk
    finally:
        os.close(read)
        if os.waitpid(pid, os.WNOHANG) == (0, 0):  # still running after 30 s without output: stuck
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert got == expected.tobytes() * 20
