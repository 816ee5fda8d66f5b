"""Reading a GGUF checkpoint into the engine's ``Weights``, through ``gguf.GGUFReader``'s memory map.

Opening reads the header (metadata and tensor table) only.  F32 / F16 / BF16 tensors become
zero-copy views of the map; quantised ones become ``QuantizedTensor`` views of their bytes,
decoded when the engine converts them; an expert-stacked tensor is split into per-expert views.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import gguf
import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import CheckpointError
from ._gguf_meta import FORMAT_VERSION, HF_CONFIG, VERSION, hf_config_from_metadata
from ._gguf_names import (GGUF_ARCH, LEGACY_WHOLE, SPLIT, STORED_SHAPE, NameRow, fused_siblings, gguf_name, qkvz_rows,
                          rope_permutation, template, v_head_order)
from ._gguf_path import split_paths
from ._gguf_tensor import QuantizedTensor
from ._kernel_file import open_or_build
from ._qkernels import REPACKERS, Packed
from ._safetensors import TensorRef
from .config import ModelConfig
from .weights import ExpertWeights, Weights, expected_shapes, expert_shapes

Q = GGMLQuantizationType
MAX_GGUF_ARRAY_ITEMS = 1 << 22
"""Items in one metadata array (4,194,304): llama.cpp vocabularies hold up to ~262k tokens and
~500k merges. Counts are also checked against the bytes left in the file before anything is
read, so a header claiming 2^40 items is refused at once instead of allocating until memory
runs out (issue 32)."""
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_VIEWS = (Q.F32, Q.F16, Q.BF16)  # read as plain numpy views, zero-copy
_GATE_UP = re.compile(r"(\.ffn_)(?:gate|up)_exps(?=\.weight$)")


@lru_cache(maxsize=None)
def decodable(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants`` can dequantise this type (probed once on one zero block)."""
    if qtype in (Q.I8, Q.I16, Q.I32, Q.I64, Q.F64):
        return False  # not weight encodings the engine computes with
    block, size = GGML_QUANT_SIZES[qtype]
    try:
        with np.errstate(all="ignore"):
            gguf.quants.dequantize(np.zeros(size, np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


class _Reader(gguf.GGUFReader):
    """``GGUFReader`` that checks each tensor's type and byte range before slicing the map, so a
    truncated file or an unknown type is reported with the tensor's name, not a reshape error."""

    def __init__(self, path: str) -> None:
        self._path = path
        super().__init__(path, "r")

    # -------- bounded header reading: every count must fit in the bytes left before it is used

    def _fits(self, what: str, count: int, item_bytes: int, offs: int) -> None:
        left = len(self.data) - offs
        if count * item_bytes > left:
            raise CheckpointError(f"the GGUF file is cut short or damaged: its header claims {count} {what} of at "
                                  f"least {item_bytes} bytes each, but only {max(left, 0)} bytes are left in the file "
                                  "(an incomplete download or copy?)", path=self._path)

    def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        slen = self._get(offset, np.uint64)
        self._fits("string bytes", int(slen[0]) if len(slen) else 1, 1, offset + 8)
        return super()._get_str(offset)

    def _build_fields(self, offs: int, count: int) -> int:
        self._fits("metadata keys", int(count), _MIN_KV_BYTES, offs)
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[Any]]:
        self._fits("tensors", int(count), _MIN_TENSOR_INFO_BYTES, offs)
        return super()._build_tensor_info(offs, count)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if not len(item_type) or not len(count):
            raise CheckpointError("GGUF file is truncated inside a metadata array", path=self._path)
        itype, n = GGUFValueType(int(item_type[0])), int(count[0])
        nptype = self.gguf_scalar_to_np.get(itype)
        item_bytes = np.dtype(nptype).itemsize if nptype is not None else 8 if itype == GGUFValueType.STRING else 12
        self._fits("array items", n, item_bytes, orig_offs + 12)
        if n > MAX_GGUF_ARRAY_ITEMS:
            raise CheckpointError(f"GGUF metadata array of {n} items (at most {MAX_GGUF_ARRAY_ITEMS})", path=self._path)
        if itype == GGUFValueType.STRING and self.byte_order in ("I", "<") and sys.byteorder == "little":
            return self._string_array(orig_offs, n)
        if nptype is None:  # nested arrays: gguf's own reader, one part per item
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(orig_offs + 12, nptype, n)  # numbers: one view for the array, not one per item
        return 12 + int(values.nbytes), [item_type, count, values], [2], [GGUFValueType.ARRAY, itype]

    def _string_array(self, orig_offs: int, n: int) -> tuple[int, list[Any], list[int], list[Any]]:
        """The parts gguf's reader makes of an array of ``n`` strings (a length and a bytes view per item), from
        plain ndarray slices: its own path makes ``np.memmap`` views through four Python calls an item, 9.5 of
        the 13 s it took to open a file carrying Qwen's 151,936-token vocabulary and 151,387 merges."""
        plain, raw = self.data.view(np.ndarray), memoryview(self.data)
        parts: list[Any] = [plain[orig_offs : orig_offs + 4].view(np.uint32), plain[orig_offs + 4 : orig_offs + 12]
                            .view(np.uint64)]
        idxs: list[int] = []
        offs = orig_offs + 12
        for _ in range(n):
            self._fits("string length bytes", 8, 1, offs)
            slen = int.from_bytes(raw[offs : offs + 8], "little")
            self._fits("string bytes", slen, 1, offs + 8)
            parts += (plain[offs : offs + 8].view(np.uint64), plain[offs + 8 : offs + 8 + slen])
            idxs.append(len(parts) - 1)
            offs += 8 + slen
        return offs - orig_offs, parts, idxs, [GGUFValueType.ARRAY, GGUFValueType.STRING] if n else [GGUFValueType.ARRAY]

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            try:
                _, name_data, _, dims, raw_type, offset = field.parts
            except ValueError:  # a future gguf changed the layout: let the reader report
                break
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = GGMLQuantizationType(int(raw_type[0]))
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise CheckpointError(f"unknown GGML tensor type {int(raw_type[0])}", path=self._path,
                                      tensor=name) from None
            n = int(np.prod([int(d) for d in dims], dtype=object))
            end = start_offs + int(offset[0]) + n // block * type_size
            if end > size:
                raise CheckpointError(f"GGUF file is truncated: tensor ends at byte {end} of {size}",
                                      path=self._path, tensor=name)
        super()._build_tensors(start_offs, fields)


class GGUFFile:
    """One memory-mapped GGUF model: metadata by key, tensors as views of the map.

    A model split by llama.cpp's ``gguf-split`` (``name-00001-of-0000N.gguf``; any shard may be
    named) is opened as one: every shard is mapped, the metadata is the first shard's, and the
    ``split.*`` keys are checked (each shard's number and count, the total tensor count)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        shards = split_paths(path) if Path(path).exists() else [Path(path)]
        self.path = str(shards[0])  # the first shard: the one holding the metadata
        self.paths = [str(p) for p in shards]
        readers = [self._open(p) for p in self.paths]
        self.reader = readers[0]
        self.tensors: dict[str, Any] = {}
        self._files: dict[str, str] = {}  # tensor name -> the shard holding it
        for reader, shard in zip(readers, self.paths):
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise CheckpointError("tensor appears in two shards", path=shard, tensor=t.name)
                self.tensors[t.name] = t
                self._files[t.name] = shard
        self.meta: Mapping[str, Any] = _Metadata(self.reader.fields, self.path)
        self._check_split(readers)
        version = self.meta.get(VERSION)
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise CheckpointError(f"written by a newer moeswarm (format {version} > {FORMAT_VERSION})", path=self.path)

    @staticmethod
    def _open(path: str) -> "_Reader":
        try:
            return _Reader(path)
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise CheckpointError("file not found", path=path) from None
        except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, RecursionError) as e:
            raise _unreadable(path, e) from None

    def _check_split(self, readers: list["_Reader"]) -> None:
        """A split model's shards must say they are shards 0..n-1 of n, holding the tensors counted."""
        split = gguf.Keys.Split
        for i, (reader, shard) in enumerate(zip(readers, self.paths)):
            meta = _Metadata(reader.fields, shard)
            count, no = meta.get(split.LLM_KV_SPLIT_COUNT), meta.get(split.LLM_KV_SPLIT_NO)
            if len(readers) == 1 and count in (None, 1):
                return
            if (count, no) != (len(readers), i):
                raise CheckpointError(f"shard {i + 1} of {len(readers)} says it is split.no {no} of split.count "
                                      f"{count}", path=shard)
        total = self.meta.get(split.LLM_KV_SPLIT_TENSORS_COUNT)
        if total != len(self.tensors):
            raise CheckpointError(f"the shards hold {len(self.tensors)} tensors; split.tensors.count says {total}",
                                  path=self.path)

    def file_of(self, name: str) -> str:
        """The shard file holding tensor ``name``."""
        return self._files.get(name, self.path)

    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def config(self) -> ModelConfig:
        """The exact ``ModelConfig`` (from the embedded config.json), else one rebuilt from llama.cpp keys."""
        model_id = str(self.meta.get("general.name") or re.sub(r"-\d{5}-of-\d{5}$", "", Path(self.path).stem))
        text = self.meta.get(HF_CONFIG)
        if text is not None:
            try:
                raw = json.loads(text)
            except (json.JSONDecodeError, TypeError) as e:
                raise CheckpointError(f"embedded {HF_CONFIG} is not valid JSON: {e}", path=self.path) from None
            if not isinstance(raw, dict):
                raise CheckpointError(f"embedded {HF_CONFIG} is not a JSON object", path=self.path)
        else:
            try:
                freqs = self.tensors.get("rope_freqs.weight")
                factors = {n: np.asarray(self.tensors[n].data)
                           for n in ("rope_factors_short.weight", "rope_factors_long.weight") if n in self.tensors}
                raw = hf_config_from_metadata(self.meta, set(self.tensors), self.architecture,
                                              None if freqs is None else np.asarray(freqs.data), factors)
            except KeyError as e:
                raise CheckpointError(f"GGUF metadata lacks {e.args[0]!r} (and has no {HF_CONFIG})",
                                      path=self.path) from None
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"malformed GGUF metadata: {e}", path=self.path) from None
            if raw.get("vocab_size") is None and "token_embd.weight" in self.tensors:
                raw["vocab_size"] = int(self.tensors["token_embd.weight"].shape[-1])  # older files lack the key
        cfg = ModelConfig.from_hf(raw, model_id=model_id, path=self.path)
        # the tensors' GGML types say how they are encoded, not the source's quantization_config
        return replace(cfg, quant=None) if cfg.quant is not None else cfg

    def config_text(self) -> str:
        """The config.json this file embeds, verbatim (so it hashes like the safetensors folder's), else
        the config rebuilt from llama.cpp's keys as canonical JSON."""
        text = self.meta.get(HF_CONFIG)
        return str(text) if text is not None else json.dumps(self.config().raw, sort_keys=True)

    def expert_encoding(self, cfg: ModelConfig) -> str:
        """How the routed experts' matrices are stored: the GGML type in lower case (``q8_0``, ``f16``)
        when all of them share it, else ``mixed-`` and a hash of which tensor has which type (llama.cpp's
        K-quant mixes vary it by layer).  Expert biases do not count: GGUF keeps 1-D tensors F32."""
        types: dict[str, str] = {}
        for L in range(cfg.num_layers):
            if cfg.moe_layers[L]:
                for part in ("gate", "up", "down"):
                    name = self.stored_name(gguf_name(cfg.arch, f"{L}.experts.0.{part}")[1])
                    types[name] = self._tensor(name).tensor_type.name
        kinds = set(types.values())
        if len(kinds) == 1:
            return kinds.pop().lower()
        return "mixed-" + hashlib.sha256(json.dumps(sorted(types.items())).encode()).hexdigest()[:8]

    def _tensor(self, name: str) -> Any:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError("missing tensor required by the model config", path=self.path, tensor=name)
        if not (t.tensor_type in _VIEWS or decodable(t.tensor_type)):
            raise CheckpointError(f"unsupported tensor type {t.tensor_type.name} (gguf cannot dequantise it)",
                                  path=self.file_of(name), tensor=name)
        return t

    def _check_shape(self, t: Any, shape: tuple[int, ...]) -> None:
        have = tuple(reversed([int(d) for d in t.shape]))
        if have != shape:
            raise CheckpointError(f"shape {list(have)} does not match the model config, which implies {list(shape)}",
                                  path=self.file_of(t.name), tensor=t.name)

    def tensor(self, name: str, shape: tuple[int, ...], rows: np.ndarray | None = None,
               cols: np.ndarray | None = None) -> Any:
        """A whole tensor: a numpy view, or a ``QuantizedTensor`` (quantised, or rows/columns to reorder)."""
        t = self._tensor(name)
        self._check_shape(t, shape)
        return _wrap(t.data, t.tensor_type, shape, rows, cols)

    def rows_of(self, name: str, start: int, shape: tuple[int, ...], total: int) -> Any:
        """Rows ``start .. start + shape[0]`` of a ``[total, shape[1]]`` tensor (DBRX's fused attn_qkv), a view."""
        t = self._tensor(name)
        self._check_shape(t, (total, *shape[1:]))
        return _wrap(t.data[start:start + shape[0]], t.tensor_type, shape, None)

    def joined(self, parts: list[tuple[str, int]], shape: tuple[int, ...], rows: np.ndarray) -> Any:
        """One ``shape`` tensor whose rows several GGUF tensors hold (name, row count each), concatenated and
        put in order by ``rows`` (Qwen3-Next's attn_qkv + attn_gate -> in_proj_qkvz).  A copy: quantized parts of
        one type stay encoded (re-ordered after decoding), parts of different types are decoded to float32."""
        tensors = [self._tensor(name) for name, _ in parts]
        for t, (_, n) in zip(tensors, parts):
            self._check_shape(t, (n, *shape[1:]))
        types = {t.tensor_type for t in tensors}
        if len(types) == 1:
            return _wrap(np.concatenate([t.data for t in tensors]), types.pop(), shape, rows)
        decoded = [np.asarray(_wrap(t.data, t.tensor_type, (n, *shape[1:]), None), np.float32)
                   for t, (_, n) in zip(tensors, parts)]
        return np.concatenate(decoded)[rows]

    def experts(self, name: str, shape: tuple[int, ...], count: int) -> Callable[[int], Any]:
        """Expert ``e`` of a stacked ``[count, *shape]`` tensor, as a view of its own bytes.  Recent llama.cpp
        may store gate and up as one ``ffn_gate_up_exps`` [count, 2 * rows, cols] (gate's rows first)."""
        fused = _GATE_UP.sub(r"\1gate_up_exps", name)
        if name not in self.tensors and fused != name and fused in self.tensors:
            t = self._tensor(fused)
            self._check_shape(t, (count, 2 * shape[0], *shape[1:]))
            start = 0 if ".ffn_gate_exps" in name else shape[0]
            return lambda e: _wrap(t.data[e][start:start + shape[0]], t.tensor_type, shape, None)
        t = self._tensor(name)
        self._check_shape(t, (count, *shape))
        return lambda e: _wrap(t.data[e], t.tensor_type, shape, None)

    def stored_name(self, name: str) -> str:
        """The tensor holding ``name``'s values: itself, or llama.cpp's fused ``ffn_gate_up_exps``."""
        fused = _GATE_UP.sub(r"\1gate_up_exps", name)
        return fused if name not in self.tensors and fused in self.tensors else name

    def byte_range(self, name: str, expert: int | None = None) -> tuple[int, int]:
        """Absolute file offsets ``[start, end)`` of a tensor (or one expert of a stack): for madvise."""
        t = self.tensors[name]  # offsets are within self.file_of(name)
        if expert is None:
            return t.data_offset, t.data_offset + t.n_bytes
        per = t.n_bytes // int(t.shape[-1])
        return t.data_offset + expert * per, t.data_offset + (expert + 1) * per


def attach_kernel_file(f: GGUFFile, cfg: ModelConfig, w: Weights) -> None:
    """Point every kernel-computed matrix of ``w`` at the kernel file beside ``f`` (built if missing or stale).
    The file covers every expert of the GGUF, held here or not: it is shared by every process on the box."""
    matrices: dict[str, QuantizedTensor] = {}  # key in the kernel file -> the matrix it repacks
    for name, a in w.tensors.items():  # the embedding is read by rows, unless the LM head shares it
        if isinstance(a, QuantizedTensor) and a.kernel_format and (name != "embed" or cfg.tie_word_embeddings):
            matrices[w.sources[name].key] = a
    eshapes = expert_shapes(cfg)
    for L in range(cfg.num_layers):
        if not cfg.moe_layers[L]:
            continue
        for k, shape in eshapes.items():
            gname = gguf_name(cfg.arch, f"{L}.experts.0.{k}")[1]
            stack = f.experts(gname, shape, cfg.num_experts)
            for e in range(cfg.num_experts):
                held = w.experts[L].get(e)
                a = getattr(held, k) if held is not None else stack(e)
                if isinstance(a, QuantizedTensor) and a.kernel_format:
                    matrices[f"{gname}[{e}]"] = a
    if not matrices:
        return
    shapes = {key: (a.shape[0], a.shape[1], REPACKERS[a.kernel_format]) for key, a in matrices.items()}

    def repack(key: str) -> Packed:
        a = matrices[key]
        p = a.repacked()
        a.release_pages()  # written out: the stored pages can leave this process
        return p

    kf = open_or_build(f.paths, shapes, repack)  # type: ignore[arg-type]
    if kf is not None:
        for key, a in matrices.items():
            a.use_kernel_file(kf, key)


def _wrap(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], rows: np.ndarray | None,
          cols: np.ndarray | None = None) -> Any:
    if rows is None and cols is None and qtype in (Q.F32, Q.F16):
        return data  # the reader's typed view
    if rows is None and cols is None and qtype == Q.BF16:
        return data.view(ml_dtypes.bfloat16)  # bytes (..., 2n) -> (..., n)
    return QuantizedTensor(data, qtype, shape, rows, cols)


class _Metadata(Mapping[str, Any]):
    """Metadata values decoded on demand (tokenizer arrays in llama.cpp files can be large)."""

    def __init__(self, fields: Mapping[str, Any], path: str) -> None:
        self._fields = fields
        self._path = path

    def __getitem__(self, key: str) -> Any:
        field = self._fields[key]
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError, TypeError) as e:
            raise CheckpointError(f"metadata {key!r} is unreadable ({type(e).__name__})", path=self._path) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


def _unpermute(row: NameRow, cfg: ModelConfig, shape: tuple[int, ...]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(rows, columns) orders that undo what the writer (or llama.cpp) did to a tensor."""
    if row.permute is None:
        return None, None
    if row.permute in ("heads", "kv_heads"):
        heads = cfg.num_heads if row.permute == "heads" else cfg.num_kv_heads
        return np.argsort(rope_permutation(shape[0], heads)), None
    rows, cols = v_head_order(row.permute, cfg, shape)
    return (None if rows is None else np.argsort(rows)), (None if cols is None else np.argsort(cols))


def _kv_b_from_split(f: GGUFFile, gname: str, cfg: ModelConfig) -> np.ndarray:
    """MLA's ``kv_b`` [heads * (nope + v), kv_lora] from llama.cpp's absorbed form: ``attn_k_b`` [heads,
    kv_lora, nope] (each head's key rows, transposed) and ``attn_v_b`` [heads, v, kv_lora] (convert_hf_to_gguf.py
    DeepseekV2Model), decoded to float32."""
    heads, nope, v, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    k_b = np.asarray(f.tensor(gname.replace("attn_kv_b", "attn_k_b"), (heads, rank, nope)), np.float32)
    v_b = np.asarray(f.tensor(gname.replace("attn_kv_b", "attn_v_b"), (heads, v, rank)), np.float32)
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(heads * (nope + v), rank)


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    return GGUFFile(path).config()


def load_gguf_weights(
    path: str | os.PathLike[str],
    *,
    config: ModelConfig | None = None,
    keep_expert: Callable[[int, int], bool] | None = None,
    kernel_file: bool = True,
) -> Weights:
    """Map a GGUF checkpoint as the same ``Weights`` a safetensors folder gives.  ``kernel_file``: take the
    quantized matrices' kernel layout from ``X.gguf.kernels`` beside it, written at the first load
    (``_kernel_file``), rather than repacking each at its first use."""
    f = GGUFFile(path)
    cfg = config or f.config()
    if cfg.quant is not None:  # a config.json beside the GGUF, from an FP8 / MXFP4 / INT4 source
        cfg = replace(cfg, quant=None)
    if f.architecture != GGUF_ARCH[cfg.arch]:
        raise CheckpointError(f"GGUF architecture {f.architecture!r} is not {GGUF_ARCH[cfg.arch]!r} "
                              f"({cfg.arch})", path=f.path)
    w = Weights(cfg, str(Path(f.path).resolve().parent), {}, {})
    shapes = expected_shapes(cfg)
    for name, shape in shapes.items():
        row, gname = gguf_name(cfg.arch, name)
        if row.fused is not None:  # a row range of a tensor several canonical ones share
            layer = name.split(".", 1)[0]
            sizes = [shapes[f"{layer}.{r.canonical.split('.', 1)[1]}"][0] for r in fused_siblings(cfg.arch, row)]
            start = sum(sizes[: row.fused])
            w.tensors[name] = f.rows_of(gname, start, shape, sum(sizes))
            w.sources[name] = TensorRef(f.file_of(gname), f"{gname}[{start}:{start + shape[0]}]")
            continue
        layer_no = template(name)[1]
        if (cfg.arch, row.canonical) in SPLIT and LEGACY_WHOLE[cfg.arch, row.canonical].format(L=layer_no) in f.tensors:
            gname = LEGACY_WHOLE[cfg.arch, row.canonical].format(L=layer_no)  # llama.cpp's older files: unsplit
            w.tensors[name] = f.tensor(gname, shape)
        elif (cfg.arch, row.canonical) in SPLIT:  # several GGUF tensors hold its rows
            pieces = qkvz_rows(cfg)
            names = [n.format(L=layer_no) for n in SPLIT[cfg.arch, row.canonical]]
            w.tensors[name] = f.joined([(n, len(r)) for n, r in zip(names, pieces)], shape,
                                       np.argsort(np.concatenate(pieces)))
            gname = "+".join(names)
        elif row.canonical == "{L}.attn.kv_b" and gname not in f.tensors:  # recent llama.cpp: split k_b / v_b
            w.tensors[name] = _kv_b_from_split(f, gname, cfg)
        elif (cfg.arch, row.canonical) in STORED_SHAPE:  # stored in another shape ([1, n], Kimi's 4-D conv)
            w.tensors[name] = np.asarray(f.tensor(gname, STORED_SHAPE[cfg.arch, row.canonical](shape))).reshape(shape)
        else:
            w.tensors[name] = f.tensor(gname, shape, *_unpermute(row, cfg, shape))
        w.sources[name] = TensorRef(f.file_of(gname.split("+")[0]), gname)
    if cfg.tie_word_embeddings:
        w.tensors["lm_head"] = w.tensors["embed"]
    eshapes = expert_shapes(cfg)
    for L in range(cfg.num_layers):
        if not cfg.moe_layers[L]:
            continue
        held = [e for e in range(cfg.num_experts) if keep_expert is None or keep_expert(L, e)]
        names = {k: gguf_name(cfg.arch, f"{L}.experts.0.{k}")[1] for k in eshapes}
        stacks = {k: f.experts(names[k], shape, cfg.num_experts) for k, shape in eshapes.items()} if held else {}
        layer: dict[int, ExpertWeights] = {}
        for e in held:
            layer[e] = ExpertWeights(**{k: cast(np.ndarray, stack(e)) for k, stack in stacks.items()})
            for k in eshapes:
                w.sources[f"{L}.experts.{e}.{k}"] = TensorRef(f.file_of(f.stored_name(names[k])), f"{names[k]}[{e}]")
        w.experts[L] = layer
    if kernel_file:
        attach_kernel_file(f, cfg, w)
    return w


__all__ = ["GGUFFile", "decodable", "load_gguf_weights", "read_config"]


def _unreadable(path: str, e: Exception) -> CheckpointError:
    """Why the gguf library could not parse ``path``, as a person can act on it (numpy's "When
    changing to a larger dtype..." means the file ended before what its header declares)."""
    with open(path, "rb") as f:
        magic = f.read(4)
        size = f.seek(0, os.SEEK_END)
    if magic != b"GGUF":
        return CheckpointError("not a GGUF file: it does not begin with the bytes 'GGUF'", path=path)
    if isinstance(e, (ValueError, IndexError)):
        return CheckpointError(f"the GGUF file is cut short or damaged: it ends after {size:,} bytes, before the "
                               "header and tensors it declares (an incomplete download or copy?)", path=path)
    return CheckpointError(f"not a readable GGUF file ({type(e).__name__}: {e})", path=path)
