"""Opening a GGUF checkpoint maps it: no expert bytes are read until an expert is used."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np

from moeswarm.model import load_model
from moeswarm.model._gguf_meta import write_metadata
from moeswarm.model._gguf_names import gguf_name
from moeswarm.model.config import ModelConfig
from moeswarm.model.gguf import QuantizedTensor
from moeswarm.model.weights import expected_shapes, expert_shapes

Q = gguf.GGMLQuantizationType


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def write_sparse_gguf(path: Path, *, hidden: int = 1024, inter: int = 4096, layers: int = 6, experts: int = 8) -> int:
    """A Mixtral GGUF of ~0.9 GiB, experts Q8_0 in even layers and F16 in odd ones.  Only the header is
    written; the tensor bytes are a file hole (zeros), so any read shows up in RSS like real data."""
    raw = {
        "model_type": "mixtral", "vocab_size": 1024, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2,
        "num_local_experts": experts, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "max_position_embeddings": 4096,
    }
    cfg = ModelConfig.from_hf(raw, model_id="big")
    w = gguf.GGUFWriter(None, "llama")
    write_metadata(w, cfg, json.dumps(raw), {}, int(gguf.LlamaFileType.MOSTLY_Q8_0))
    sizes = []

    def add(name: str, shape: tuple[int, ...], qtype: Q) -> None:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        if qtype == Q.Q8_0:
            w.add_tensor_info(name, gguf.quant_shape_to_byte_shape(shape, qtype), np.dtype(np.uint8), nbytes, qtype)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32 if qtype == Q.F32 else np.float16), nbytes, qtype)
        sizes.append(nbytes)

    for name, shape in expected_shapes(cfg).items():
        add(gguf_name("mixtral", name)[1], shape, Q.F16 if len(shape) == 2 else Q.F32)
    for L in range(layers):
        for part, shape in expert_shapes(cfg).items():
            add(gguf_name("mixtral", f"{L}.experts.0.{part}")[1], (experts, *shape), Q.Q8_0 if L % 2 == 0 else Q.F16)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    start = w.fout[0].tell()
    w.close()
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    total = -(-start // align) * align + sum(-(-n // align) * align for n in sizes)
    os.truncate(path, total)
    return total


def test_opening_a_gguf_reads_no_expert_bytes(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    size = write_sparse_gguf(path)
    assert size > 0.8 * 2**30
    before = _status_bytes("VmRSS")
    model = load_model(path)
    opened = _status_bytes("VmRSS")
    print(f"file {size / 2**20:.0f} MiB; opening grew RSS by {(opened - before) / 2**20:.1f} MiB")
    assert opened - before < 0.05 * size
    assert len(model.weights.experts[5]) == 8
    # Negative controls: the measurement does see reads.  A Q8_0 expert decodes from its own bytes...
    q8 = model.weights.experts[2][7].gate
    assert isinstance(q8, QuantizedTensor) and q8.qtype == Q.Q8_0
    file_before = _status_bytes("RssFile")
    assert float(q8.astype(np.float32).sum()) == 0.0
    file_after = _status_bytes("RssFile")
    assert file_after - file_before >= 0.9 * q8.nbytes
    # ... and an F16 expert is a plain view of the map.
    f16 = model.weights.experts[3][1].down
    assert f16.dtype == np.float16 and not f16.flags.writeable
    assert float(f16.sum()) == 0.0
    assert _status_bytes("RssFile") - file_after >= 0.9 * f16.nbytes
