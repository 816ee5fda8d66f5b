"""GGUF checkpoints: convert a Hugging Face folder to GGUF, and serve from a GGUF file.

Writing (``convert_to_gguf``, CLI ``moeswarm convert-gguf``) uses the ``gguf`` package's
``GGUFWriter`` with llama.cpp's tensor names and metadata keys (see ``_gguf_names`` for the table
and the few names llama.cpp lacks).  Routed experts are stacked per layer into
``blk.N.ffn_{gate,up,down}_exps`` and quantised (F32/F16/BF16/Q8_0/Q5_x/Q4_x); norms, biases and
routers stay F32.  For exactness the original ``config.json`` is embedded as the string
``moeswarm.hf_config`` and the tokenizer files as ``moeswarm.tokenizer_json`` etc.

Reading (``load_gguf_weights``; ``moeswarm.model.checkpoint.load_weights`` dispatches to it for a ``.gguf`` file or a folder
holding exactly one and no safetensors) returns the engine's ``Weights``: F32/F16/BF16 tensors are
zero-copy views of ``GGUFReader``'s memory map, quantised ones (incl. the K-quants ``gguf`` can
decode) are ``QuantizedTensor`` views of their bytes, dequantised one expert at a time when
``experts.f32`` converts them.  Opening reads only the header.

Typical use::

    from moeswarm.model.gguf import convert_to_gguf
    convert_to_gguf("models/qwen3-moe", "out/qwen3-moe.Q8_0.gguf", weight_type="F16", experts_type="Q8_0")
    model = load_model("out/qwen3-moe.Q8_0.gguf")    # or load_model("out/") with one .gguf inside
"""

from __future__ import annotations

import os

from ._gguf_meta import EMBEDDED_FILES, HF_CONFIG
from ._gguf_names import GGUF_ARCH, NAME_MAP, NameRow
from ._gguf_path import find_gguf
from ._gguf_read import GGUFFile, decodable, load_gguf_weights, read_config
from ._gguf_tensor import QuantizedTensor
from ._gguf_write import WEIGHT_TYPES, ConvertReport, TensorPlan, convert_to_gguf


def hf_to_gguf(arch: str) -> dict[str, str]:
    """The explicit HF -> GGUF name map of an architecture (templates with ``{L}``, ``{E}``)."""
    return {row.hf: row.gguf for row in NAME_MAP[arch]}


def embedded_file(path: str | os.PathLike[str], name: str) -> str | None:
    """The text of a file embedded in a GGUF written by ``convert_to_gguf`` (``config.json``,
    ``tokenizer.json``, ``tokenizer_config.json``...), or None."""
    key = HF_CONFIG if name == "config.json" else EMBEDDED_FILES.get(name)
    if key is None:
        return None
    value = GGUFFile(path).meta.get(key)
    return None if value is None else str(value)


__all__ = [
    "GGUF_ARCH",
    "NAME_MAP",
    "WEIGHT_TYPES",
    "ConvertReport",
    "GGUFFile",
    "NameRow",
    "QuantizedTensor",
    "TensorPlan",
    "convert_to_gguf",
    "decodable",
    "embedded_file",
    "find_gguf",
    "hf_to_gguf",
    "load_gguf_weights",
    "read_config",
]
