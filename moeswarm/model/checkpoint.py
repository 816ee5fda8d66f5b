"""Open a checkpoint in either stored form: a Hugging Face folder (config.json + safetensors) or GGUF.

This is the one place that knows both formats, so neither reader imports the other:
``config.py`` parses config.json, ``weights.py`` maps safetensors, ``_gguf_read.py`` maps GGUF
(imported on use: the ``gguf`` library is heavy).
"""

from __future__ import annotations

import os
from dataclasses import replace
from collections.abc import Callable

import numpy as np

from ..errors import CheckpointError
from ._gguf_path import find_gguf
from .config import ModelConfig
from .mtp import LAYOUT
from .weights import Weights, load_safetensors


def load_config(folder: str | os.PathLike[str]) -> ModelConfig:
    """From ``folder/config.json``; a ``.gguf`` file (or a folder holding only one) reads its metadata.
    A GGUF's weights are encoded as its tensor types say: a ``quantization_config`` in the
    config.json it was converted from (an FP8 checkpoint's) does not apply to them."""
    gguf_file = find_gguf(folder)
    if gguf_file is None:
        _check_folder(folder)
    if gguf_file is not None and not (os.path.isdir(folder) and os.path.exists(os.path.join(folder, "config.json"))):
        from ._gguf_read import read_config

        return read_config(gguf_file)
    cfg = ModelConfig.from_folder(folder)
    if gguf_file is not None:
        return replace(cfg, quant=None) if cfg.quant is not None else cfg
    return _with_stored_mtp(cfg, folder)


def _with_stored_mtp(cfg: ModelConfig, folder: str | os.PathLike[str]) -> ModelConfig:
    """``cfg`` with the multi-token-prediction layers the folder's safetensors hold (headers only)."""
    from ._safetensors import open_folder
    from .mtp import stored_keys, stored_mtp_layers, with_mtp

    if cfg.arch not in LAYOUT or not os.path.isdir(folder):
        return cfg
    try:
        keys = open_folder(folder)
    except CheckpointError:
        return cfg  # no weights here (a config-only folder): nothing to add; loading them says what is wrong
    return with_mtp(cfg, stored_mtp_layers(cfg, stored_keys(cfg, keys)))


def load_weights(
    folder: str | os.PathLike[str],
    *,
    config: ModelConfig | None = None,
    keep_expert: Callable[[int, int], bool] | None = None,
) -> Weights:
    """Map a model folder.  ``keep_expert(layer, expert)`` selects the experts to hold (default: all)."""
    gguf_file = find_gguf(folder)  # a .gguf file, or a folder with one and no safetensors
    if gguf_file is not None:
        from ._gguf_read import load_gguf_weights

        return fold_norm_offset(load_gguf_weights(gguf_file, config=config, keep_expert=keep_expert))
    _check_folder(folder)
    return fold_norm_offset(load_safetensors(folder, config=config, keep_expert=keep_expert))


def _check_folder(folder: str | os.PathLike[str]) -> None:
    """A checkpoint that is not GGUF is a folder: say so plainly when ``folder`` is something else."""
    if os.path.isfile(folder):
        raise CheckpointError("this is a file, not a model folder: give the folder that holds config.json and "
                              "*.safetensors, or a .gguf file", path=str(folder))
    if not os.path.isdir(folder):
        raise CheckpointError("model folder not found", path=str(folder))


def fold_norm_offset(w: Weights) -> Weights:
    """Gemma-style RMSNorms (MiniMax M3) scale by ``1 + w``: store that sum, so the engine's norms
    (which scale by ``w``) compute the same.  Norm weights are small vectors; nothing else is copied."""
    offset = w.config.norm_offset
    if offset:
        for name, a in w.tensors.items():
            if name.endswith("norm"):
                w.tensors[name] = a.astype(np.float32) + np.float32(offset)
    return w


__all__ = ["load_config", "load_weights"]
