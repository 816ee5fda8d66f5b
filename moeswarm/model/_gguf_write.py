"""Hugging Face folder -> GGUF, streamed one tensor (one expert) at a time.

The source is read through ``load_weights``, so every layout the engine understands (per-expert,
packed, gpt-oss's interleaved experts, even another GGUF) converts the same way.  Each canonical
tensor is renamed by the table in ``_gguf_names``; experts are stacked per layer into
``blk.N.ffn_{gate,up,down}_exps`` and quantised expert by expert, straight into the file, so
memory stays at about one expert's float32 copy whatever the model size.

Types: ``weight_type`` applies to every 2-D weight, ``experts_type`` (default: the same) to the
routed experts.  1-D tensors (norms, biases, sinks) and the routers (``ffn_gate_inp``,
``ffn_gate_inp_shexp``) stay F32, as llama.cpp keeps them.  A matrix whose rows are not a whole
number of quant blocks falls back to F16, as llama.cpp does; the report says which.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape, quantize

from ..errors import ConfigError
from ._gguf_meta import EMBEDDED_FILES, HF_CONFIG, llama3_factors, phimoe_rope_factors, write_metadata
from ._gguf_names import (GGUF_ARCH, SPLIT, STORED_SHAPE, WRITE_ABSORBED, absorbed_kv_b, fused_siblings, gguf_name,
                          qkvz_rows, rope_permutation, template, v_head_order)
from ._gguf_path import find_gguf
from ._gguf_read import GGUFFile
from .checkpoint import load_weights
from .weights import Weights

Q = GGMLQuantizationType
# Types gguf.quants can *encode* in numpy (K-quants and IQ types it can only decode).
WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
_F32_ALWAYS = ("{L}.router", "{L}.shared_gate")  # routing decisions are kept exact


@dataclass
class TensorPlan:
    """One GGUF tensor to write: its name, encoding and source arrays (one per expert if stacked)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: [E, I, H] for a gate/up stack
    parts: tuple[np.ndarray, ...]
    rows: np.ndarray | None = None  # llama.cpp's q/k row permutation, applied before encoding
    note: str = ""  # why the type differs from the one asked for
    cols: np.ndarray | None = None  # a column permutation, applied before encoding (Qwen3.5's ssm_out)

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size

    def encode(self, a: np.ndarray) -> np.ndarray:
        a = np.asarray(a)  # a QuantizedTensor source (GGUF -> GGUF) decodes here
        if self.rows is not None:
            a = a[self.rows]
        if self.cols is not None:
            a = a[:, self.cols]
        if self.qtype == Q.F32:
            return np.ascontiguousarray(a, dtype=np.float32)
        if self.qtype == Q.F16:
            return np.ascontiguousarray(a, dtype=np.float16)
        return quantize(np.ascontiguousarray(a, dtype=np.float32), self.qtype)

    def tofile(self, fh: IO[bytes]) -> None:
        """Write the encoded bytes part by part (``GGUFWriter.write_tensor_data`` calls this)."""
        for part in self.parts:
            self.encode(part).tofile(fh)


@dataclass
class ConvertReport:
    path: Path
    file_bytes: int
    tensors: list[TensorPlan]
    sidecars: list[str] = field(default_factory=list)  # files written beside the GGUF
    shards: list[Path] = field(default_factory=list)  # every file of the model (several when split)

    def bytes_per_expert(self) -> dict[str, int]:
        """Encoded bytes of one routed expert (gate + up + down [+ biases]) -> keyed by the types
        of its matrices ("Q8_0", or "F16+Q8_0" when some fell back); empty for a dense model."""
        out: dict[str, int] = {}
        for layer in sorted({p.name.split(".")[1] for p in self.tensors if "_exps." in p.name}):
            stacks = [p for p in self.tensors if p.name.startswith(f"blk.{layer}.") and "_exps." in p.name]
            label = "+".join(sorted({p.qtype.name for p in stacks if p.name.endswith(".weight")}))
            out.setdefault(label, sum(p.nbytes // p.shape[0] for p in stacks))
        return out


def _qtype(name: str) -> GGMLQuantizationType:
    if name.upper() not in WEIGHT_TYPES:
        raise ConfigError(f"unsupported GGUF weight type {name!r}; choose one of {', '.join(WEIGHT_TYPES)}")
    return GGMLQuantizationType[name.upper()]


def _choose(canonical: str, shape: tuple[int, ...], wanted: GGMLQuantizationType) -> tuple[GGMLQuantizationType, str]:
    if len(shape) == 1 or template(canonical)[0] in _F32_ALWAYS or template(canonical)[0].endswith("_bias"):
        return Q.F32, ""
    block = GGML_QUANT_SIZES[wanted][0]
    if shape[-1] % block:
        return Q.F16, f"rows of {shape[-1]} are not a whole number of {wanted.name} blocks ({block}): F16"
    return wanted, ""


def plan(w: Weights, weight_type: str = "F16", experts_type: str | None = None) -> list[TensorPlan]:
    """Every tensor of ``w`` as a GGUF tensor, in layer order."""
    cfg = w.config
    base, etype = _qtype(weight_type), _qtype(experts_type or weight_type)
    plans: list[tuple[tuple[int, int], TensorPlan]] = []
    for name, a in w.tensors.items():
        if name == "lm_head" and cfg.tie_word_embeddings:
            continue  # llama.cpp omits output.weight for tied embeddings
        if (template(name)[1] or 0) >= cfg.num_layers:
            continue  # multi-token-prediction layers (model/mtp.py) are not converted
        row, gname = gguf_name(cfg.arch, name)
        layer = template(name)[1]
        if row.fused is not None:  # one GGUF tensor of several canonical ones, their rows in order
            if row.fused != 0:
                continue
            parts = tuple(w.tensors[r.canonical.format(L=layer)] for r in fused_siblings(cfg.arch, row))
            shape = (sum(p.shape[0] for p in parts), a.shape[1])
            qtype, note = _choose(name, shape, base)
            plans.append(((layer if layer is not None else cfg.num_layers, 0),
                          TensorPlan(gname, qtype, shape, parts, None, note)))
            continue
        if (cfg.arch, row.canonical) in WRITE_ABSORBED:  # MLA's kv_b as llama.cpp's attn_k_b / attn_v_b
            for gname_part, part in zip(WRITE_ABSORBED[cfg.arch, row.canonical], absorbed_kv_b(a, cfg)):
                qtype, note = _choose(name, part.shape, base)
                plans.append(((layer if layer is not None else cfg.num_layers, 0),
                              TensorPlan(gname_part.format(L=layer), qtype, part.shape, (part,), None, note)))
            continue
        if (cfg.arch, row.canonical) in SPLIT:  # one canonical tensor's rows as several GGUF tensors
            for gname_part, part_rows in zip(SPLIT[cfg.arch, row.canonical], qkvz_rows(cfg)):
                shape = (len(part_rows), a.shape[1])
                qtype, note = _choose(name, shape, base)
                plans.append(((layer if layer is not None else cfg.num_layers, 0),
                              TensorPlan(gname_part.format(L=layer), qtype, shape, (a,), part_rows, note)))
            continue
        qtype, note = _choose(name, a.shape, base)
        rows = cols = None
        reshape = STORED_SHAPE.get((cfg.arch, template(name)[0]))
        shape = reshape(tuple(a.shape)) if reshape else tuple(a.shape)
        if row.permute in ("heads", "kv_heads"):
            rows = rope_permutation(a.shape[0], cfg.num_heads if row.permute == "heads" else cfg.num_kv_heads)
        elif row.permute:
            rows, cols = v_head_order(row.permute, cfg, a.shape)
        order = -1 if name == "embed" else (layer if layer is not None else cfg.num_layers)
        plans.append(((order, 0), TensorPlan(gname, qtype, shape, (a,), rows, note, cols)))
    for L, experts in w.experts.items():
        if L >= cfg.num_layers:
            continue
        if sorted(experts) != list(range(cfg.num_experts)):
            raise ConfigError(f"layer {L} holds experts {sorted(experts)}; converting needs all {cfg.num_experts}")
        for part in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
            arrays = tuple(getattr(experts[e], part) for e in range(cfg.num_experts))
            if arrays[0] is None:
                continue
            canonical = f"{L}.experts.0.{part}"
            shape = (cfg.num_experts, *arrays[0].shape)
            qtype, note = _choose(canonical, arrays[0].shape, etype)
            plans.append(((L, 1), TensorPlan(gguf_name(cfg.arch, canonical)[1], qtype, shape, arrays, None, note)))
    if cfg.arch in ("llama4", "llama4_text") and cfg.rope.kind == "llama3":  # llama.cpp's form of the scaling
        factors = llama3_factors(cfg.rope)
        plans.append(((-1, 1), TensorPlan("rope_freqs.weight", Q.F32, factors.shape, (factors,))))
    if cfg.arch == "phimoe":  # longrope's factors, as llama.cpp's rope_factors_short / _long tensors
        for name, factors in phimoe_rope_factors(cfg).items():
            plans.append(((-1, 1), TensorPlan(name, Q.F32, factors.shape, (factors,))))
    plans.sort(key=lambda item: item[0])
    return [p for _, p in plans]


def _file_type(qtype: GGMLQuantizationType) -> int:
    names = {Q.F32: "ALL_F32", Q.F16: "MOSTLY_F16", Q.Q4_K: "MOSTLY_Q4_K_M", Q.Q5_K: "MOSTLY_Q5_K_M"}
    return int(getattr(gguf.LlamaFileType, names.get(qtype, f"MOSTLY_{qtype.name}"), gguf.LlamaFileType.GUESSED))


def write_gguf(out: Path, w: Weights, plans: list[TensorPlan], files: dict[str, str],
               on_tensor: Callable[[TensorPlan], None] | None = None, split_max_size: int = 0,
               spm_model: Path | None = None) -> list[Path]:
    """Header, metadata and tensor table first, then each tensor's bytes; returns the files written.
    ``files``: name -> text of config.json and the tokenizer files, embedded verbatim; ``spm_model``: a
    SentencePiece tokenizer.model (binary), written as llama.cpp's vocabulary only.

    ``split_max_size`` > 0 splits the model as llama.cpp's ``gguf-split --split-max-size`` does:
    ``out``'s stem + ``-00001-of-0000N.gguf``..., no shard's tensors above that many bytes (unless
    one tensor alone is), the metadata in the first, ``split.no`` / ``split.count`` /
    ``split.tensors.count`` in each.  Atomic: written in a ``.part`` folder beside ``out``, then moved."""
    cfg = w.config
    writer = gguf.GGUFWriter(None, GGUF_ARCH[cfg.arch], split_max_size=split_max_size)
    expert_types = [p.qtype for p in plans if "_exps.weight" in p.name]
    write_metadata(writer, cfg, files.get("config.json") or json.dumps(cfg.raw, indent=2), files,
                   _file_type(expert_types[0] if expert_types else plans[0].qtype), spm_model)
    for p in plans:
        if p.qtype in (Q.F32, Q.F16):
            dtype = np.dtype(np.float32 if p.qtype == Q.F32 else np.float16)
            writer.add_tensor_info(p.name, p.shape, dtype, p.nbytes, raw_dtype=p.qtype)
        else:
            byte_shape = quant_shape_to_byte_shape(p.shape, p.qtype)
            writer.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), p.nbytes, raw_dtype=p.qtype)
    part = out.with_name(f".{out.name}.part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    try:
        writer.write_header_to_file(path=part / out.name)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in plans:
            # A TensorPlan stands in for the array: the writer only asks for .nbytes and .tofile().
            writer.write_tensor_data(p)  # type: ignore[arg-type]
            if on_tensor is not None:
                on_tensor(p)
        writer.close()
        written = []
        for f in sorted(part.iterdir()):
            os.replace(f, out.with_name(f.name))
            written.append(out.with_name(f.name))
        return written
    finally:
        writer.close()
        shutil.rmtree(part, ignore_errors=True)


def _source_files(model: str | os.PathLike[str], w: Weights) -> dict[str, str]:
    """config.json and the tokenizer files, verbatim: from the GGUF being re-encoded, else the folder."""
    source = find_gguf(model)
    if source is not None:
        meta = GGUFFile(source).meta
        keys = {"config.json": HF_CONFIG, **EMBEDDED_FILES}
        return {name: str(meta[key]) for name, key in keys.items() if key in meta}
    out = {}
    for name in ("config.json", *EMBEDDED_FILES):
        try:
            out[name] = (Path(w.folder) / name).read_bytes().decode("utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            continue
    return out


def convert_to_gguf(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    weight_type: str = "F16",
    experts_type: str | None = None,
    sidecar: bool = True,
    on_tensor: Callable[[TensorPlan], None] | None = None,
    split_max_size: int = 0,
    on_plan: Callable[[list[TensorPlan]], None] | None = None,
) -> ConvertReport:
    """Convert a model folder (or a GGUF file) to a GGUF file.

    ``on_plan`` hears every tensor's plan before any is written, ``on_tensor`` each as it is written.
    ``split_max_size`` > 0 writes llama.cpp's split layout (``write_gguf``); ``path`` is then the
    first shard.  ``sidecar`` also writes config.json and the tokenizer files beside it, byte for byte (never
    overwriting), so its folder works as a model folder everywhere.  The swarm still tells the GGUF
    apart from the safetensors checkpoint: its model id adds the experts' encoding to the hash of
    config.json (``mixtral-76b2c92d8168-q8_0``, see ``moeswarm.model.model_id.model_id_for``).
    """
    out = Path(out)
    if out.suffix != ".gguf":
        raise ConfigError(f"the output file must end in .gguf: {out}")
    w = load_weights(model)
    if w.config.arch not in GGUF_ARCH:  # e.g. MiniMax M3: llama.cpp names no architecture for it
        raise ConfigError(f"{w.config.arch} has no GGUF form: llama.cpp's gguf package names no architecture "
                          f"for it (GGUF covers {', '.join(GGUF_ARCH)})")
    plans = plan(w, weight_type, experts_type)
    if on_plan is not None:  # e.g. a progress bar's total: the bytes of every tensor to write
        on_plan(plans)
    files = _source_files(model, w)
    files.setdefault("config.json", json.dumps(w.config.raw, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    spm = Path(w.folder) / "tokenizer.model" if find_gguf(model) is None else None
    shards = write_gguf(out, w, plans, files, on_tensor, split_max_size, spm)
    written = []
    if sidecar:
        for name, text in files.items():
            if not (out.parent / name).exists():
                (out.parent / name).write_bytes(text.encode("utf-8"))
                written.append(name)
        spm = Path(w.folder) / "tokenizer.model"  # binary SentencePiece model: beside only
        if find_gguf(model) is None and spm.is_file() and not (out.parent / spm.name).exists():
            shutil.copyfile(spm, out.parent / spm.name)
            written.append(spm.name)
    return ConvertReport(shards[0], sum(f.stat().st_size for f in shards), plans, written, shards)
