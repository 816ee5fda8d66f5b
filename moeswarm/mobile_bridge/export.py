"""``moeswarm export-onnx``: a checkpoint's experts as ONNX layer shards for onnxruntime.

One ``layer_LLLL.onnx`` per MoE layer holds the chosen experts of that layer (graph in
``_graph``); its weights live in ``layer_LLLL.onnx.data`` (ONNX external data), each tensor at a
64 KiB-aligned offset so onnxruntime can memory-map the file instead of copying it (open the
session with prepacking disabled for that, see ``shards.session_options``). The model's
``config.json`` is copied beside them and ``manifest.json`` lists everything with SHA-256 hashes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import onnx
from onnx import TensorProto, external_data_helper

from ..errors import ConfigError
from ..model import load_config, load_weights
from ..model.model_id import model_id_for
from ._graph import DTYPES, OPSET, Activation, layer_graph
from ._manifest import Manifest, ShardEntry, sha256_file

ALIGNMENT = 64 * 1024  # external tensors start on this boundary (mmap granularity on every OS)
SMALL_TENSOR = 1024  # tensors below this many bytes (scalars, split sizes) stay inside the graph


def shard_file(layer: int) -> str:
    return f"layer_{layer:04d}.onnx"


def _externalize(model: onnx.ModelProto, folder: Path, data_name: str) -> None:
    """Move every large initializer's bytes into ``data_name``, page-aligned, in graph order."""
    offset = 0
    with open(folder / data_name, "wb") as fh:
        for tensor in model.graph.initializer:
            raw = tensor.raw_data
            if len(raw) < SMALL_TENSOR:
                continue
            offset += -offset % ALIGNMENT
            fh.seek(offset)
            fh.write(raw)
            external_data_helper.set_external_data(tensor, data_name, offset=offset, length=len(raw))
            tensor.ClearField("raw_data")
            tensor.data_location = TensorProto.EXTERNAL
            offset += len(raw)


def export_onnx(model_dir: str | Path, out_dir: str | Path, *, layers: tuple[int, int] | None = None,
                experts: tuple[int, int] | None = None, dtype: str = "fp32",
                model_id: str | None = None, on_layer: Callable[[int, int], None] | None = None) -> Manifest:
    """Export ``experts`` (inclusive range, default all) of every MoE layer in ``layers``.

    ``out_dir`` is created; existing shard files in it are overwritten. Returns the manifest
    (also written to ``out_dir/manifest.json``).  ``on_layer(done, total)`` hears of each MoE
    layer written (a progress bar).
    """
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    cfg = load_config(model_dir)
    Activation.of(cfg)  # fail early on an activation the graph cannot express
    layers = layers or (0, cfg.num_layers - 1)
    experts = experts or (0, cfg.num_experts - 1)
    if not 0 <= layers[0] <= layers[1] < cfg.num_layers:
        raise ConfigError(f"layers {layers[0]}-{layers[1]} are outside 0-{cfg.num_layers - 1}")
    if not 0 <= experts[0] <= experts[1] < cfg.num_experts:
        raise ConfigError(f"experts {experts[0]}-{experts[1]} are outside 0-{cfg.num_experts - 1}")
    moe = [L for L in range(layers[0], layers[1] + 1) if cfg.moe_layers[L]]
    if not moe:
        raise ConfigError(f"layers {layers[0]}-{layers[1]} hold no MoE layer")
    keep = lambda L, e: L in moe and experts[0] <= e <= experts[1]  # noqa: E731
    weights = load_weights(model_dir, config=cfg, keep_expert=keep)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(model_dir) / "config.json", out / "config.json")
    shards = []
    if on_layer is not None:
        on_layer(0, len(moe))
    for L in moe:
        name = shard_file(L)
        model = layer_graph(L, weights.experts[L], cfg, dtype)
        _externalize(model, out, name + ".data")
        onnx.save_model(model, str(out / name))
        onnx.checker.check_model(str(out / name))
        shards.append(ShardEntry(L, experts, name, name + ".data",
                                 {n: sha256_file(out / n) for n in (name, name + ".data")}))
        if on_layer is not None:
            on_layer(len(shards), len(moe))
    manifest = Manifest(
        model_id=model_id or model_id_for(str(model_dir), cfg), arch=cfg.arch, dtype=dtype,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
        activation=cfg.expert_activation, layers=layers, experts=experts, shards=tuple(shards),
        files={"config.json": sha256_file(out / "config.json")}, opset=OPSET,
    )
    manifest.write(out)
    return manifest
