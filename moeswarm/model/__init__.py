"""The numpy MoE inference engine: checkpoints, converters, architectures, backends, generation.

Typical use::

    from moeswarm.model import SamplingParams, Tokenizer, generate, load_model
    model = load_model("path/to/model")          # memory-maps the checkpoint
    ids = Tokenizer.from_folder("path/to/model").encode("Hello")
    for token in generate(model, ids, SamplingParams(max_new_tokens=20)): ...
"""

from __future__ import annotations

import os
from collections.abc import Callable

from . import _config_dots1_ernie, _config_glm4, _config_hunyuan, _config_qwen3_next  # noqa: F401 - register more families
from . import _config_dbrx, _config_granite, _config_llama4, _config_mistral4, _config_phimoe  # noqa: F401
from . import _config_kimi_linear, _config_longcat, _config_mimo, _config_minimax_text01  # noqa: F401
from . import _attn_dsv4, _config_dsv4, _residual_hc  # noqa: F401 - DeepSeek-V4
from . import _attn_ml4, _config_mistral_large4  # noqa: F401 - Mistral Large 4
from . import _config_minimax_kimi, _rules_minimax_kimi  # noqa: F401
from .attention import KVCache
from .checkpoint import load_config, load_weights
from .config import ARCHITECTURES, ModelConfig
from .experts import BACKENDS, expert_ffn, get_backend
from .generate import SamplingParams, generate, sample
from .tokenizer import StreamDecoder, Tokenizer
from .transformer import ExpertExecutor, ExpertHandle, LocalExperts, Model
from .weights import ExpertWeights, Weights


def load_gguf_weights(*args, **kwargs):  # type: ignore[no-untyped-def]
    """``moeswarm.model.gguf.load_gguf_weights`` (imported on use: the gguf package is heavy)."""
    from .gguf import load_gguf_weights as load

    return load(*args, **kwargs)


def load_model(
    folder: str | os.PathLike[str],
    *,
    backend: str = "auto",
    keep_expert: Callable[[int, int], bool] | None = None,
    experts: ExpertExecutor | None = None,
) -> Model:
    """Open a model folder (memory-mapped; nothing but headers is read) as a ready ``Model``."""
    get_backend(backend)  # fail early on a bad name
    return Model(load_weights(folder, keep_expert=keep_expert), experts=experts, backend=backend)


__all__ = [
    "ARCHITECTURES",
    "BACKENDS",
    "ExpertExecutor",
    "ExpertHandle",
    "ExpertWeights",
    "KVCache",
    "LocalExperts",
    "Model",
    "ModelConfig",
    "SamplingParams",
    "StreamDecoder",
    "Tokenizer",
    "Weights",
    "expert_ffn",
    "generate",
    "get_backend",
    "load_config",
    "load_model",
    "load_gguf_weights",
    "load_weights",
    "sample",
]
