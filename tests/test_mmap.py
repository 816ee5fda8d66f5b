"""Opening a checkpoint maps it; it must not read (or copy) the tensors' bytes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from moeswarm.model import load_model

GiB = 1 << 30


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def write_big_mixtral(folder: Path, *, hidden: int = 1024, inter: int = 4096, layers: int = 6, experts: int = 8) -> int:
    """A Mixtral checkpoint of fp32 tensors > 2 GiB.  Tensor bytes are left as file holes (read
    back as zeros), so writing is instant and any read shows up in RSS just like real data."""
    folder.mkdir(parents=True, exist_ok=True)
    V, heads, kv, hd = 1024, 8, 2, hidden // 8
    shapes: dict[str, list[int]] = {
        "model.embed_tokens.weight": [V, hidden],
        "model.norm.weight": [hidden],
        "lm_head.weight": [V, hidden],
    }
    for L in range(layers):
        p = f"model.layers.{L}."
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = [hidden]
        shapes[p + "self_attn.q_proj.weight"] = [heads * hd, hidden]
        shapes[p + "self_attn.k_proj.weight"] = shapes[p + "self_attn.v_proj.weight"] = [kv * hd, hidden]
        shapes[p + "self_attn.o_proj.weight"] = [hidden, heads * hd]
        shapes[p + "block_sparse_moe.gate.weight"] = [experts, hidden]
        for e in range(experts):
            q = p + f"block_sparse_moe.experts.{e}."
            shapes[q + "w1.weight"] = shapes[q + "w3.weight"] = [inter, hidden]
            shapes[q + "w2.weight"] = [hidden, inter]
    header: dict[str, object] = {}
    offset = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(folder / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        fh.truncate(8 + len(blob) + offset)
    config = {
        "model_type": "mixtral", "vocab_size": V, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "num_local_experts": experts, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "max_position_embeddings": 4096,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return 8 + len(blob) + offset


def test_opening_a_2gb_checkpoint_reads_no_tensor_bytes(tmp_path: Path) -> None:
    size = write_big_mixtral(tmp_path / "big")
    assert size > 2 * GiB
    before = _status_kib("VmRSS") * 1024
    model = load_model(tmp_path / "big")
    opened = _status_kib("VmRSS") * 1024
    assert opened - before < 0.05 * size, f"opening grew RSS by {(opened - before) / 2**20:.0f} MiB"
    assert len(model.weights.experts[5]) == 8
    # Negative control: the measurement does see reads.  Touch one expert (50 MiB of file pages).
    expert = model.weights.experts[3][7]
    assert float(expert.gate.sum()) == 0.0
    touched = _status_kib("VmRSS") * 1024
    assert touched - opened >= 0.9 * expert.gate.nbytes


def test_views_are_read_only_memory_maps(tmp_path: Path) -> None:
    write_big_mixtral(tmp_path / "m", hidden=64, inter=128, layers=1, experts=2)
    model = load_model(tmp_path / "m")
    gate = model.weights.experts[0][1].gate
    assert not gate.flags.writeable
    with pytest.raises(ValueError):
        gate[0, 0] = 1.0
