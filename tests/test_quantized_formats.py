"""Quantised checkpoints as their families publish them (FP8 e4m3 block-scaled as DeepSeek-V3 ships,
MXFP4 as gpt-oss ships, INT4 pack-quantized as Kimi K2.x ships) load in their stored bytes, decode by
the documented formulas, compute what transformers computes on the same checkpoint, and travel to a
fetching backbone as stored, checked against the publisher's digests."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open

from moeswarm.model import SamplingParams, generate, load_model, load_weights
from moeswarm.model._stored import StoredTensor
from moeswarm.model.memory import expert_ranges
from moeswarm.model.weights import stored_expert_bytes
from moeswarm.net.dataplane import DataPlaneServer, ServerConfig
from moeswarm.net.client import ExpertClient
from moeswarm.node.fetch import DIGESTS_FILE, expert_digest, fetch_expert, load_expert_digests, serve_weights, \
    write_expert_digests
from moeswarm.protocol import ErrorCode, Identity
from moeswarm.errors import ProtocolError

import quantized_checkpoints as qc

TOL = 1e-4
# INT4: transformers (compressed-tensors) rounds each decoded weight q * scale to bf16, at most 2^-9
# relative; the engine keeps it exact in float32. Through these 3-layer models that moved the logits
# by 0.87 x 2^-9 x max|logit| (7.0e-3); 4x that leaves room and stays under what dropping the
# quantisation altogether moves them (> 0.1, asserted below); a wrong scale or nibble moves them by
# the logits' own size.
BF16_EPS = 2.0**-9
BF16_TOL_FACTOR = 4.0
FORMATS = {  # format -> (oracle architecture, layout it is written from, writer)
    "fp8": ("deepseek_v3", "per_expert", qc.write_fp8),  # 8 x 16 blocks: several per matrix here
    "fp8_128": ("deepseek_v3", "per_expert", lambda src, dst: qc.write_fp8(src, dst, block=(128, 128))),  # as published
    "mxfp4": ("gpt_oss", "packed", qc.write_mxfp4),
    "int4": ("deepseek_v3", "per_expert", qc.write_int4),
}


class Quantised:
    def __init__(self, oracle_checkpoints, root: Path) -> None:  # type: ignore[no-untyped-def]
        self.oc, self.root, self.cache = oracle_checkpoints, root, {}

    def get(self, fmt: str):  # type: ignore[no-untyped-def]
        if fmt not in self.cache:
            arch, layout, write = FORMATS[fmt]
            src, float_ref = self.oc.get(arch, layout)
            folder = write(src, self.root / fmt)
            self.cache[fmt] = (folder, qc.transformers_reference(folder, self.oc.prompt), float_ref)
        return self.cache[fmt]


@pytest.fixture(scope="module")
def quantised(oracle_checkpoints, tmp_path_factory) -> Quantised:  # type: ignore[no-untyped-def]
    return Quantised(oracle_checkpoints, tmp_path_factory.mktemp("quantised"))


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantised_checkpoint_computes_what_transformers_computes_on_it(quantised, fmt: str) -> None:
    folder, ref, float_ref = quantised.get(fmt)
    # the quantisation matters: the float model's logits are far from the quantised one's
    assert np.abs(ref.prefill_logits - float_ref.prefill_logits).max() > 0.1
    model = load_model(folder, backend="eager")
    cache = model.new_cache()
    prefill = model.forward(np.asarray([ref.prompt_ids]), cache)[0]
    decode = np.stack([model.forward(np.asarray([[t]]), cache)[0, -1] for t in ref.decode_tokens])
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    diff = float(np.abs(np.concatenate([prefill, decode]) - expected).max())
    bound = BF16_TOL_FACTOR * BF16_EPS * float(np.abs(expected).max()) if fmt == "int4" else TOL
    print(f"{fmt}: max |logit diff| vs transformers {diff:.2e} (bound {bound:.2e})")
    assert diff <= bound
    tokens = list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens))))
    assert tokens == ref.greedy_tokens
    # every routed expert is still its stored bytes after generating: nothing was decoded in place
    for layer in model.weights.experts.values():
        for w in layer.values():
            assert all(isinstance(getattr(w, p), StoredTensor) for p in ("gate", "up", "down"))


def _expected_parts(fmt: str, folder: Path, layer: int, expert: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(codes bytes, scales) of one expert's matrices read with the safetensors package, in the
    engine's [out, in] orientation (gpt-oss: gate rows 0::2, up rows 1::2 of gate_up)."""
    t = file_tensors(folder)
    out = {}
    if fmt == "mxfp4":
        p = f"model.layers.{layer}.mlp.experts."
        gu_b, gu_s = t[p + "gate_up_proj_blocks"][expert], t[p + "gate_up_proj_scales"][expert]
        dn_b, dn_s = t[p + "down_proj_blocks"][expert], t[p + "down_proj_scales"][expert]
        out["gate"] = (gu_b[0::2].reshape(gu_b.shape[0] // 2, -1).numpy(), gu_s[0::2].numpy())
        out["up"] = (gu_b[1::2].reshape(gu_b.shape[0] // 2, -1).numpy(), gu_s[1::2].numpy())
        out["down"] = (dn_b.reshape(dn_b.shape[0], -1).numpy(), dn_s.numpy())
        return out
    for name in ("gate", "up", "down"):
        p = f"model.layers.{layer}.mlp.experts.{expert}.{name}_proj."
        if fmt.startswith("fp8"):
            out[name] = (t[p + "weight"].view(torch.uint8).numpy(), t[p + "weight_scale_inv"].numpy())
        else:
            out[name] = (t[p + "weight_packed"].view(torch.uint8).numpy(),
                         t[p + "weight_scale"].view(torch.int16).numpy())
    return out


def _documented_dequant(fmt: str, folder: Path, layer: int, expert: int) -> dict[str, np.ndarray]:
    """The dequantised matrices by the formats' own code or documentation, not the engine's."""
    t = file_tensors(folder)
    out = {}
    if fmt == "mxfp4":  # transformers' own MXFP4 decoder, then its [E, in, out] -> [out, in]
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        p = f"model.layers.{layer}.mlp.experts."
        gu = convert_moe_packed_tensors(t[p + "gate_up_proj_blocks"], t[p + "gate_up_proj_scales"],
                                        dtype=torch.float32)[expert].T
        dn = convert_moe_packed_tensors(t[p + "down_proj_blocks"], t[p + "down_proj_scales"],
                                        dtype=torch.float32)[expert].T
        return {"gate": gu[0::2].numpy(), "up": gu[1::2].numpy(), "down": dn.numpy()}
    for name in ("gate", "up", "down"):
        p = f"model.layers.{layer}.mlp.experts.{expert}.{name}_proj."
        if fmt.startswith("fp8"):  # DeepSeek-V3's weight_dequant: w * scale_inv of the br x bc block it sits in
            br, bc = json.loads((folder / "config.json").read_text())["quantization_config"]["weight_block_size"]
            w, s = t[p + "weight"].float(), t[p + "weight_scale_inv"]
            out[name] = (w * s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: w.shape[0], : w.shape[1]]).numpy()
        else:  # compressed-tensors' own unpacking, times the group's scale
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

            shape = torch.Size(t[p + "weight_shape"].tolist())
            q = unpack_from_int32(t[p + "weight_packed"], 4, shape).float()
            s = t[p + "weight_scale"].float().repeat_interleave(16, 1)
            out[name] = (q * s).numpy()
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_are_held_as_their_stored_bytes_and_decode_by_the_documented_formula(quantised, fmt: str) -> None:
    folder, _, _ = quantised.get(fmt)
    weights = load_weights(folder)
    for layer, expert in ((1, 0), (1, 5)):
        held = weights.experts[layer][expert]
        stored = _expected_parts(fmt, folder, layer, expert)
        formula = _documented_dequant(fmt, folder, layer, expert)
        for name in ("gate", "up", "down"):
            t = getattr(held, name)
            codes, scale = stored[name]
            assert np.array_equal(t.codes, codes.view(np.uint8)), name
            assert t.scale.tobytes() == scale.tobytes(), name
            assert np.array_equal(t.astype(np.float32), formula[name]), name
        # the expert is counted at its stored size (codes + scales + biases), here and by the planner
        biases = [a for a in (held.gate_bias, held.up_bias, held.down_bias) if a is not None]
        stored_bytes = sum(c.nbytes + s.nbytes for c, s in stored.values())
        assert held.nbytes == stored_bytes + sum(b.nbytes for b in biases)
        assert stored_expert_bytes(weights.config) == stored_bytes + 2 * sum(b.size for b in biases)
        # and it is a view into the checkpoint's memory map: its pages are the file's
        ranges = expert_ranges(held)
        assert ranges and all(path == str(folder / "model.safetensors") for path, _, _ in ranges)
        assert sum(length for _, _, length in ranges) >= stored_bytes


def _digest_from_file(fmt: str, folder: Path, layer: int, expert: int) -> str:
    """``expert_digests.json``'s format computed from the safetensors file: for gate, up, down:
    "|name|uint8|rows,bytes|" + the stored codes, then "|name_scale|dtype|dims|" + the scales."""
    h = hashlib.sha256(b"moeswarm-expert-digests/1")
    for name, (codes, scale) in _expected_parts(fmt, folder, layer, expert).items():
        codes = np.ascontiguousarray(codes.view(np.uint8))
        h.update(f"|{name}|uint8|{','.join(map(str, codes.shape))}|".encode() + codes.tobytes())
        dtype = {np.dtype(np.int16): "bfloat16"}.get(scale.dtype, str(scale.dtype))
        h.update(f"|{name}_scale|{dtype}|{','.join(map(str, scale.shape))}|".encode() + scale.tobytes())
    if fmt == "mxfp4":  # gpt-oss experts have biases, which stay float
        t = file_tensors(folder)
        p = f"model.layers.{layer}.mlp.experts."
        gu, dn = t[p + "gate_up_proj_bias"][expert].numpy(), t[p + "down_proj_bias"][expert].numpy()
        for name, b in (("gate_bias", gu[0::2]), ("up_bias", gu[1::2]), ("down_bias", dn)):
            b = np.ascontiguousarray(b)
            h.update(f"|{name}|{b.dtype}|{b.shape[0]}|".encode() + b.tobytes())
    return h.hexdigest()


async def _no_calls(client, request):  # type: ignore[no-untyped-def]
    raise ProtocolError("no expert calls here", code=ErrorCode.UNKNOWN_EXPERT)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_fetching_backbone_receives_the_stored_bytes_and_checks_their_digest(quantised, fmt: str,
                                                                               tmp_path: Path) -> None:
    folder, _, _ = quantised.get(fmt)
    weights = load_weights(folder)
    cfg = weights.config
    write_expert_digests(weights, tmp_path / DIGESTS_FILE, model_id="m")
    digests = load_expert_digests(tmp_path / DIGESTS_FILE, cfg)
    assert digests is not None
    sent: list[int] = []

    async def main():  # type: ignore[no-untyped-def]
        async def weights_handler(client, request):  # type: ignore[no-untyped-def]
            response = serve_weights(weights, "m", request)
            sent.append(response.data.nbytes)
            return response

        async with DataPlaneServer(Identity.generate(), _no_calls, ServerConfig(),
                                   weights_handler=weights_handler) as srv:
            client = await ExpertClient.connect(srv.endpoint, Identity.generate())
            try:
                return await fetch_expert(client, cfg, "m", 1, 5)
            finally:
                await client.aclose()

    got = asyncio.run(main())
    held = weights.experts[1][5]
    for name in ("gate", "up", "down"):
        g, h = getattr(got, name), getattr(held, name)
        assert isinstance(g, StoredTensor) and g.codes.dtype == np.uint8
        assert np.array_equal(g.codes, h.codes) and g.scale.tobytes() == h.scale.tobytes()
        assert np.array_equal(g.astype(np.float32), h.astype(np.float32))
    # what travelled is the stored size, not a float copy
    assert sum(sent) == got.nbytes == held.nbytes
    assert held.nbytes < 0.6 * 2 * (3 * cfg.hidden_size * cfg.moe_intermediate_size)  # < 60% of bf16
    # the digest the publisher wrote is over the stored bytes, and the fetched copy matches it
    assert digests[(1, 5)] == _digest_from_file(fmt, folder, 1, 5)
    assert expert_digest(got, cfg) == digests[(1, 5)]
    tampered = StoredTensor(got.gate.fmt, got.gate.shape, got.gate.codes ^ np.uint8(1), got.gate.scale)
    assert expert_digest(type(got)(tampered, got.up, got.down, got.gate_bias, got.up_bias, got.down_bias),
                         cfg) != digests[(1, 5)]


def test_config_names_the_stored_format_and_refuses_the_unknown(tmp_path: Path) -> None:
    from moeswarm.errors import CheckpointError
    from moeswarm.model.config import ModelConfig

    base = json.loads(json.dumps({"model_type": "mixtral", "vocab_size": 8, "hidden_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "intermediate_size": 128}))
    cfg = ModelConfig.from_hf({**base, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                "weight_block_size": [128, 128]}})
    assert cfg.quant is not None and cfg.quant.block == (128, 128)
    assert stored_expert_bytes(cfg) == 3 * (64 * 128 + 1 * 1 * 4)
    for qc_, why in [({"quant_method": "awq"}, "not supported"),
                     ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size"),
                     ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "pack-quantized")]:
        with pytest.raises(CheckpointError, match=why):
            ModelConfig.from_hf({**base, "quantization_config": qc_}, path="x/config.json")


def test_every_code_decodes_as_the_reference_decoders_do() -> None:
    """All 256 byte values (FP8 incl. subnormals and NaN; every pair of FP4 / INT4 nibbles), with
    scales from tiny to large, against torch's float8 and the formats' own libraries."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moeswarm.model._stored import dequant_fp8_block, dequant_int4_group, dequant_mxfp4

    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    fp8 = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float()
    scale = np.array([[2.0**-20, 3.0], [0.015625, 1e3]], dtype=np.float32)  # 2 x 2 blocks of 8 x 8
    want = (fp8 * torch.from_numpy(scale).repeat_interleave(8, 0).repeat_interleave(8, 1)).numpy()
    assert np.array_equal(dequant_fp8_block(codes, scale, (8, 8)), want, equal_nan=True)
    assert np.isnan(dequant_fp8_block(codes, scale, (8, 8))).sum() == 2  # 0x7F and 0xFF
    # shapes that are not whole blocks (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows of 128-row blocks)
    part = codes[:, :12][:, :].repeat(2, axis=0)[:20]  # (20, 12): scale grid ceil(20/8) x ceil(12/8) = 3 x 2
    grid = np.array([[0.5, 2.0], [4.0, 0.25], [8.0, 1.0]], dtype=np.float32)
    ref = torch.from_numpy(part.copy()).view(torch.float8_e4m3fn).float()
    ref = ref * torch.from_numpy(grid).repeat_interleave(8, 0)[:20].repeat_interleave(8, 1)[:, :12]
    assert np.array_equal(dequant_fp8_block(part, grid, (8, 8)), ref.numpy(), equal_nan=True)

    blocks = np.arange(256, dtype=np.uint8).reshape(16, 1, 16)  # 16 rows, one group of 32 each
    e8m0 = np.array([1, 60, 100, 120, 125, 126, 127, 128, 129, 130, 135, 140, 150, 160, 180, 200], dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks[None]), torch.from_numpy(e8m0.reshape(1, 16, 1)),
                                      dtype=torch.float32)[0].T.numpy()  # [in, out] -> [out, in]
    assert np.array_equal(dequant_mxfp4(blocks.reshape(16, 16), e8m0.reshape(16, 1)), want)

    words = torch.from_numpy(np.arange(256, dtype=np.uint8).reshape(8, 32).copy()).view(torch.int32)  # (8, 8)
    q = unpack_from_int32(words, 4, torch.Size([8, 64])).float()
    s = torch.tensor(np.linspace(0.001, 3.0, 8 * 4, dtype=np.float32).reshape(8, 4)).to(torch.bfloat16)
    want = (q * s.float().repeat_interleave(16, 1)).numpy()
    got = dequant_int4_group(words.view(torch.uint8).numpy(), s.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    assert np.array_equal(got, want)


def test_a_quantised_checkpoint_converts_to_gguf(quantised, tmp_path: Path) -> None:
    """convert-gguf reads the stored experts through their decoders: an F32 GGUF of the FP8
    checkpoint computes the same logits; its embedded config.json keeps the quantization_config,
    which no longer applies to its GGML-typed tensors."""
    from moeswarm.model import load_config
    from moeswarm.model.gguf import convert_to_gguf

    folder, ref, _ = quantised.get("fp8")
    report = convert_to_gguf(folder, tmp_path / "g" / "m.gguf", weight_type="F32", sidecar=True)
    assert (tmp_path / "g" / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    for name in (report.path, tmp_path / "g"):
        assert load_config(name).quant is None
        model = load_model(name)
        assert not isinstance(model.weights.experts[1][0].gate, StoredTensor)
        got = model.forward(np.asarray([ref.prompt_ids]), model.new_cache())[0]
        assert np.abs(got - ref.prefill_logits).max() <= TOL


def test_generate_cli_on_a_published_fp8_folder(quantised) -> None:
    import subprocess
    import sys

    folder, ref, _ = quantised.get("fp8")
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", str(folder), "--prompt-ids",
                           json.dumps(ref.prompt_ids), "--max-new-tokens", str(len(ref.greedy_tokens)),
                           "--print-token-ids"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ref.greedy_tokens
