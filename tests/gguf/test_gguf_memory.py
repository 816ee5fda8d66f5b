"""Decoding a quantized GGUF stays within its stored size plus the caches built from it: the kernels take the
place of the mapped weights (no second or third copy inside onnxruntime, no float32 copies of whole tensors).
Measured on ``moeswarm generate --stats`` processes (their figures, and their RSS sampled from outside), so
this process's own memory does not mix in."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest

from moeswarm.model._gguf_meta import write_metadata
from moeswarm.model._gguf_names import gguf_name
from moeswarm.model.config import ModelConfig
from moeswarm.model.weights import expected_shapes, expert_shapes
from rss_support import generate_sampling_rss

pytestmark = pytest.mark.slow  # 7-25 s (machine load): writes 180 MiB and decodes in two processes
Q = gguf.GGMLQuantizationType
EXPERTS = 8
SLACK = 16 << 20  # RSS sampled every ~2 ms: a repack's transient arrays, activations, the KV cache


def write_q8_gguf(path: Path, layers: int, rng: np.random.Generator) -> int:
    """A Mixtral GGUF (hidden 512, expert width 1536) with every matrix Q8_0 of random codes, weights ~
    N(0, 1/fan_in); returns the tensor bytes written."""
    raw = {"model_type": "mixtral", "vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1536,
           "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2,
           "num_local_experts": EXPERTS, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
           "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "max_position_embeddings": 4096}
    cfg = ModelConfig.from_hf(raw, model_id="q8-memory")
    w = gguf.GGUFWriter(path, "llama")
    write_metadata(w, cfg, json.dumps(raw), {}, int(gguf.LlamaFileType.MOSTLY_Q8_0))
    stored = 0

    def q8_0(shape: tuple[int, ...], std: float) -> np.ndarray:
        blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 32, 34), dtype=np.uint8)
        blocks[..., :2] = np.float16(std / 73).reshape(1).view(np.uint8)  # int8 codes uniform: std ~73
        return blocks.reshape(*shape[:-1], -1)

    for name, shape in expected_shapes(cfg).items():
        a = q8_0(shape, 1 / np.sqrt(shape[-1]) if "embed" not in name else 1.0) if len(shape) == 2 else \
            np.ones(shape, np.float32)
        w.add_tensor(gguf_name("mixtral", name)[1], a, raw_dtype=Q.Q8_0 if len(shape) == 2 else None)
        stored += a.nbytes
    for L in range(layers):
        for part, shape in expert_shapes(cfg).items():
            a = q8_0((EXPERTS, *shape), 1 / np.sqrt(shape[-1]))
            w.add_tensor(gguf_name("mixtral", f"{L}.experts.0.{part}")[1], a, raw_dtype=Q.Q8_0)
            stored += a.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def generate_with_stats(path: Path, tokens: int) -> tuple[list[int], int, str]:
    """``moeswarm generate --stats`` in a subprocess: (its tokens, its peak VmRSS sampled every ~2 ms, stderr)."""
    return generate_sampling_rss(path, "[1, 5, 70, 300, 9, 42, 600, 17]", tokens, timeout_s=240)


def mib(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    assert m is not None, f"{pattern!r} not in --stats output:\n{text}"
    return int(m.group(1)) << 20


@dataclass
class Run:
    stored: int  # tensor bytes written
    grown: int  # peak VmRSS sampled from outside minus VmRSS before loading (as --stats prints it)
    anon: int  # private memory at the end (--stats)
    file: int  # mapped file pages at the end (--stats)
    caches: int  # kernels built from the weights, as --stats counts them (backbone + expert cache)
    experts: int  # experts in the cache


def decode(path: Path, layers: int) -> Run:
    stored = write_q8_gguf(path, layers, np.random.default_rng(layers))
    tokens, peak, err = generate_with_stats(path, 32)
    print(err)
    assert len(tokens) == 32
    # --stats shows the figures: the weights' stored size and the resident set, before loading and now
    assert abs(mib(r"weights stored (\d+) MiB", err) - stored) <= 1 << 20
    before = mib(r"VmRSS \d+ MiB \(anon \d+, file \d+; (\d+) MiB before loading\)", err)
    assert before < mib(r"VmRSS (\d+) MiB \(anon", err) <= peak
    caches = mib(r"backbone kernels/copies (\d+) MiB", err) + mib(r"expert cache (\d+) MiB", err)
    experts = int(re.search(r"expert cache \d+ MiB \((\d+) experts\)", err).group(1))  # type: ignore[union-attr]
    return Run(stored, peak - before, mib(r"\(anon (\d+),", err), mib(r"\(anon \d+, file (\d+);", err), caches, experts)


def test_decoding_a_quantized_gguf_stays_within_its_stored_size_plus_caches(tmp_path: Path) -> None:
    """What an 8-layer file costs beyond a 1-layer file of the same shapes (the interpreter's lazy imports,
    onnxruntime's library and thread pool: not the model) while decoding."""
    small, big = decode(tmp_path / "small.gguf", 1), decode(tmp_path / "big.gguf", 8)
    stored, caches = big.stored - small.stored, big.caches - small.caches
    print(f"8 - 1 layers: stored {stored / 2**20:.0f} MiB, caches {caches / 2**20:.0f} MiB; peak RSS grew "
          f"{(big.grown - small.grown) / 2**20:.0f} MiB more, anon {(big.anon - small.anon) / 2**20:.0f}, file "
          f"{(big.file - small.file) / 2**20:.0f}")
    assert stored >= 128 << 20  # the difference stands well above the interpreter's ~40 MiB
    assert big.experts >= 0.75 * 8 * EXPERTS  # most of the model was computed on, so most of it is held
    # the caches are counted at their kernels' size, not inflated: Q8_0 stores 34 bytes per 32 weights, its kernel
    # (MLAS's int8 layout, as MatMulNBits for the backbone and a layer's QMoE for the experts: _qkernels.kernel_nbytes,
    # _qmoe.kernel_nbytes) 32 codes and 3 floats, + ~0.2 MiB per session
    assert big.caches <= 1.45 * big.stored and 44 / 34 * 0.75 * stored <= caches
    # the acceptance: RSS while decoding stays within the stored size plus the caches
    assert big.grown - small.grown <= stored + caches + SLACK
    # and tighter: the private memory is the caches (no copy of a weight beside its kernel, no float32 copies) ...
    assert big.anon - small.anon <= caches + SLACK
    # ... while the stored pages a kernel was built from leave the resident set
    assert big.file - small.file <= 0.05 * stored


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rss_file() -> int:
    return _rss("RssFile")


def _fp16_file(tmp_path: Path):  # type: ignore[no-untyped-def]
    """An expert (gate, up, down) and a backbone matrix, 9 MiB each as fp16, mapped from a file."""
    rng = np.random.default_rng(0)
    shape = (3, 1536, 1024)
    source = rng.standard_normal((2, *shape)).astype(np.float16)
    (tmp_path / "w.bin").write_bytes(source.tobytes())
    return source, np.memmap(tmp_path / "w.bin", np.float16, "r", shape=(2, *shape))


def test_fp16_weights_are_computed_from_their_mapped_pages(tmp_path: Path) -> None:
    """With the F16 kernel (``_f16``): an fp16 expert's cache entry and a backbone matrix compute from the mapped
    fp16 pages: no private (anonymous) memory beyond a product's output, the expert cache and the backbone count no
    bytes built from them, and the products are the float32 copy's within float32 summation."""
    from moeswarm.model._f16 import StoredLinear
    from moeswarm.model.experts import DecodedOnce, F32Cache, mm
    from moeswarm.model.weights import ExpertWeights

    source, mapped = _fp16_file(tmp_path)
    stored = mapped[0].nbytes
    x = np.random.default_rng(1).standard_normal((2, 1024)).astype(np.float32)
    cache = F32Cache(64 << 20)
    anon = _rss("RssAnon")
    kept = cache.get((0, 0), ExpertWeights(mapped[0, 0], mapped[0, 1], mapped[0, 2]))
    backbone = DecodedOnce(mapped[1].reshape(-1, 1024))
    outputs = [mm(x, getattr(kept, p)) for p in ("gate", "up")] + [mm(x, backbone)]
    grown = _rss("RssAnon") - anon
    print(f"anonymous RSS grew {grown / 2**20:.1f} MiB for {2 * stored / 2**20:.0f} MiB of fp16 weights computed on")
    assert all(isinstance(getattr(kept, p), StoredLinear) for p in ("gate", "up", "down"))
    assert cache._copies.bytes == 0 and backbone.kernel_nbytes == 0  # nothing built: the stored pages compute
    assert grown < 0.1 * stored  # a float32 copy of either would be 2x stored
    for y, w in zip(outputs, [source[0, 0], source[0, 1], source[1].reshape(-1, 1024)]):
        w32 = w.astype(np.float32)
        assert np.abs(y - x @ w32.T).max() <= 1024 * 2.0**-24 * (np.abs(x) @ np.abs(w32).T).max()


def test_without_the_f16_kernel_fp16_weights_leave_the_resident_set_once_their_float32_copy_is_kept(
        tmp_path: Path, monkeypatch) -> None:
    """Where the F16 kernel is not built (or the CPU lacks F16C), an F16 file's experts and backbone matrices are
    computed as float32 copies: once a copy is kept, the stored pages go back to the file instead of staying
    resident beside it."""
    from moeswarm.model import _f16
    from moeswarm.model.experts import DecodedOnce, F32Cache
    from moeswarm.model.weights import ExpertWeights

    monkeypatch.setattr(_f16, "ISA", 0)
    source, mapped = _fp16_file(tmp_path)
    expected = [source[0, i].astype(np.float32) for i in range(3)] + [source[1].astype(np.float32)]
    stored = mapped[0].nbytes

    before = _rss_file()
    expert = ExpertWeights(mapped[0, 0], mapped[0, 1], mapped[0, 2])
    float(sum(a.astype(np.float32).sum() for a in expert.arrays()))  # resident now, as after any read
    read = _rss_file()
    assert read - before >= 0.9 * stored  # the measurement sees the pages
    kept = F32Cache(64 << 20).get((0, 0), expert)
    assert all(np.array_equal(getattr(kept, p), e) for p, e in zip(("gate", "up", "down"), expected))
    assert read - _rss_file() >= 0.9 * stored

    backbone = DecodedOnce(mapped[1].reshape(-1, 1024))
    assert backbone.kernel is None
    float(mapped[1].astype(np.float32).sum())
    read = _rss_file()
    assert np.array_equal(backbone.value(), expected[3].reshape(-1, 1024))
    assert read - _rss_file() >= 0.9 * stored
    # a copy the cache does not keep (bigger than its budget) leaves the pages where they are
    float(sum(a.astype(np.float32).sum() for a in expert.arrays()))
    read = _rss_file()
    F32Cache(1 << 20).get((0, 0), expert)
    assert abs(read - _rss_file()) < 0.1 * stored
