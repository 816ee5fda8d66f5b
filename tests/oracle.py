"""Test-side oracle: tiny random MoE checkpoints built with Hugging Face transformers, plus reference logits.

Test-only code (imports torch and transformers). The engine under test (``moeswarm.model``) must never import it.

Public API
----------
``ARCHS``, ``LAYOUTS``, ``EXTRA_ARCHS``, ``PROMPT``
``build_checkpoint(arch, layout, out_dir, seed=0) -> Path``
``reference_run(model_dir, prompt_ids, n_decode=8) -> Reference``
``write_legacy_rope_config(model_dir) -> dict``
``load_model(model_dir, **config_overrides)``: the transformers model for a checkpoint dir (either layout)
``router_stats``, ``gpt_oss_clamp_stats``, ``deepseek_group_routing_stats``, ``verify_gpt_oss_per_expert``:
self-check helpers used by ``tests/test_oracle_selfcheck.py``.

Architectures
-------------
``ARCHS`` are the six model families; ``EXTRA_ARCHS`` holds optional variants (built only when asked for):
``deepseek_v3_no_q_lora`` is DeepSeek-V3 with ``q_lora_rank=None`` (a plain ``self_attn.q_proj``, as in
DeepSeek-V2-Lite) and default RoPE; its ``config.json`` still says ``model_type: deepseek_v3``.

All models: vocab 512, hidden 64, 4 attention heads, fp32, ``attn_implementation="eager"``, ids pad=0, bos=1,
eos=2, ``tie_word_embeddings=False``, max_position_embeddings 256. See ``CONFIGS`` for the exact values.

Weights are re-initialised "hot" (see ``reinit_hot``) so that routing is far from uniform and every block
matters numerically: Linear/router/expert weights N(0, 1/fan_in), norm weights 1 + 0.1 N, every bias
(including ``e_score_correction_bias``) 0.1 N, attention sinks N(0, 1), embeddings N(0, 1). Every parameter and
persistent buffer is overwritten from a generator seeded with ``seed``, so a given (arch, seed) always gives the
same weights, whatever the layout.

On-disk layouts
---------------
``per_expert``
    The hub layout: plain ``save_pretrained`` (``save_original_format=True``), one 2-D tensor per expert, e.g.
    ``model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight`` (mixtral:
    ``model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight`` and ``block_sparse_moe.gate.weight``).
    deepseek_v3 per_expert (and deepseek_v3_no_q_lora per_expert) is saved **sharded**
    (``model.safetensors.index.json`` + several ``model-0000k-of-0000n.safetensors``).

    gpt_oss has no per-expert format in transformers (it is always packed there), so for ``per_expert`` this
    module writes ``model.safetensors`` itself, splitting every packed expert tensor into, for each layer L and
    expert E (nn.Linear convention, weight = [out, in]):

    ====================================================  ========  =====================================
    name                                                  shape     source (packed tensor)
    ====================================================  ========  =====================================
    ``model.layers.L.mlp.experts.E.gate_proj.weight``     [I, H]    ``gate_up_proj[E][:, 0::2].T``
    ``model.layers.L.mlp.experts.E.gate_proj.bias``       [I]       ``gate_up_proj_bias[E][0::2]``
    ``model.layers.L.mlp.experts.E.up_proj.weight``       [I, H]    ``gate_up_proj[E][:, 1::2].T``
    ``model.layers.L.mlp.experts.E.up_proj.bias``         [I]       ``gate_up_proj_bias[E][1::2]``
    ``model.layers.L.mlp.experts.E.down_proj.weight``     [H, I]    ``down_proj[E].T``
    ``model.layers.L.mlp.experts.E.down_proj.bias``       [H]       ``down_proj_bias[E]``
    ====================================================  ========  =====================================

    Every other tensor (router, attention incl. sinks, norms, embeddings, lm_head) is written unchanged under
    its usual name; ``config.json`` and ``generation_config.json`` are exactly those of the packed save.
    ``verify_gpt_oss_per_expert`` checks that this round-trips bit-exactly to the packed tensors, and
    ``load_model`` re-packs it so transformers can run it.

``packed``
    ``save_pretrained(..., save_original_format=False)``: the transformers runtime layout, e.g.
    ``model.layers.L.mlp.experts.gate_up_proj [E, 2I, H]`` (rows 0:I gate, I:2I up) and
    ``mlp.experts.down_proj [E, H, I]`` (no ``.weight`` suffix; mixtral is renamed to ``mlp.*``).
    gpt_oss: ``mlp.experts.gate_up_proj [E, H, 2I]`` with gate/up interleaved (``[..., 0::2]`` gate,
    ``[..., 1::2]`` up), ``gate_up_proj_bias [E, 2I]`` (interleaved the same way), ``down_proj [E, I, H]``,
    ``down_proj_bias [E, H]``.

Values the engine must honour (see ``CONFIGS``; all are in each checkpoint's config.json)
----------------------------------------------------------------------------------------
* mixtral: rope_theta 1e6, E=8 top-2 (always renormalised), rms_norm_eps 1e-5, head_dim 16.
* qwen2_moe: 3 layers, ``mlp_only_layers=[1]`` (layer 1 dense, intermediate_size 128), ``norm_topk_prob=False``,
  shared expert (96) times sigmoid(shared_expert_gate), q/k/v biases, E=16 top-4, rope_theta 1e6.
* qwen3_moe: ``norm_topk_prob=True``, ``head_dim=32`` (!= hidden/heads), per-head q/k RMSNorm, rope_theta 1e6.
* olmoe: ``norm_topk_prob=False``, q_norm over the whole q projection [64], k_norm over [n_kv*head_dim = 32].
* deepseek_v3: 3 layers, ``first_k_dense_replace=1``, sigmoid + e_score_correction_bias, ``n_group=4``,
  ``topk_group=2``, top-4 of 16, ``norm_topk_prob=True``, ``routed_scaling_factor=2.5``, 1 shared expert,
  MLA (q_lora_rank 32, kv_lora_rank 16, qk_nope 16 + qk_rope 8 = qk_head_dim 24, v_head_dim 16),
  ``rope_interleave=True``, YaRN (``DEEPSEEK_YARN``: factor 4, original 64, mscale = mscale_all_dim = 1, truncate
  defaults to True): cos/sin factor 1.0, softmax scale 24**-0.5 * (0.1*ln 4 + 1)**2.
  ``deepseek_v3_no_q_lora``: q_lora_rank None, default RoPE (theta 1e4), softmax scale 24**-0.5.
* gpt_oss: ``layer_types=["sliding_attention", "full_attention"]``, ``sliding_window=6`` (query at p sees keys
  p-5..p), sinks, all-bias attention, router bias, top-k on logits then softmax over the k, clamped SwiGLU
  with ``swiglu_limit=1.5`` (gate clamped above, up clamped to [-1.5, 1.5]), ``swiglu_alpha=1.702``,
  YaRN (``GPT_OSS_YARN``: factor 4, original 64, ``truncate=False``): cos/sin scaled by 0.1*ln 4 + 1.
* deepseek_v32: DeepSeek-V3's MLA and routing (``_DSA``) plus the DSA indexer: ``index_topk=6`` of the 16 prompt
  keys, 16 indexer heads of 16 dims (first 8 rotated, halves layout), ``mlp_layer_types`` dense, sparse, sparse;
  YaRN as deepseek_v3.  Per-expert saves are a single file (not sharded).
* glm_moe_dsa: 4 layers, ``mlp_layer_types`` dense, sparse, dense, sparse; ``indexer_types`` full, shared, full,
  shared (shared layers reuse the previous top-k and have no indexer tensors); interleaved indexer RoPE; n_group 1;
  rope_theta 1e6; experts 48 wide.
* qwen3_5_moe: the vision-language checkpoint (``model.language_model.*``, a ~10 MB ``model.visual.*`` tower,
  ``lm_head``); ``layer_types`` linear, full, linear; DeltaNet with 2 key heads and 4 value heads of 16 dims,
  conv kernel 4; gated full attention, head_dim 32, partial rotary 0.25; zero-centred RMSNorms (``1 + weight``);
  E=8 top-2 with a gated shared expert.  Its DeltaNet prefill is chunked by 64 tokens, so tests that exercise the
  chunking use prompts of ``QWEN3_5_PROMPT_LEN`` (80) tokens.

Reference semantics
-------------------
``reference_run`` does one prefill over the prompt (logits for every prompt position) and then ``n_decode``
single-token steps on the same ``DynamicCache`` (passed as ``cache=``, the transformers 5.24 name of
``past_key_values``), each feeding the greedy argmax of the previous logits. Torch runs single-threaded.
Per_expert and packed references of one arch agree to ~1.5e-6 (not bit-exact, pitfall 9).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DeepseekV3Config,
    DeepseekV32Config,
    DynamicCache,
    GlmMoeDsaConfig,
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Qwen3_5MoeConfig,
)
from transformers.utils import logging as hf_logging  # noqa: E402

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss") + ("deepseek_v32", "glm_moe_dsa", "qwen3_5_moe")
EXTRA_ARCHS = ("deepseek_v3_no_q_lora",)
LAYOUTS = ("per_expert", "packed")

#: fixed 16-token prompt, ids in [3, 512)
PROMPT = [505, 470, 216, 421, 376, 498, 44, 308, 218, 37, 361, 215, 263, 314, 424, 242]

#: per_expert saves with this max_shard_size (-> model.safetensors.index.json + several shards)
SHARDED_PER_EXPERT = {"deepseek_v3": "400KB", "deepseek_v3_no_q_lora": "400KB"}

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _deepseek(q_lora_rank: int | None, rope: dict) -> DeepseekV3Config:
    return DeepseekV3Config(
        **{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},  # MLA: n_kv == n_heads (pitfall 5)
        rms_norm_eps=1e-6,
        intermediate_size=128,  # dense MLP of layer 0
        moe_intermediate_size=32,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=True,
        num_mtp_layers=0,  # no MTP weights are written
        rope_parameters=rope,
    )


#: DeepSeek-V3-style YaRN (mscale / mscale_all_dim as on the hub; softmax scale gets mscale(factor, all_dim)**2)
DEEPSEEK_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,  # 64 * 4 == max_position_embeddings; ramp has a partial blend at i=1
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

GPT_OSS_YARN = dict(
    rope_type="yarn",
    rope_theta=150000.0,
    factor=4.0,
    original_max_position_embeddings=64,  # 64 * 4 == max_position_embeddings (pitfall 7: else it warns)
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
)

CONFIGS: dict[str, Callable[[], Any]] = {
    "mixtral": lambda: MixtralConfig(
        **_COMMON,
        head_dim=16,
        intermediate_size=96,
        num_local_experts=8,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **{**_COMMON, "num_hidden_layers": 3},
        rms_norm_eps=1e-6,
        intermediate_size=128,  # dense MLP of the mlp_only_layers
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],  # layer 1 is a dense Qwen2MoeMLP (mlp.{gate,up,down}_proj)
        qkv_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON,
        head_dim=32,  # != hidden / heads (as in Qwen3-30B-A3B): q_proj is [128, 64]
        rms_norm_eps=1e-6,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
    ),
    "olmoe": lambda: OlmoeConfig(
        **_COMMON,
        rms_norm_eps=1e-5,
        intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    "deepseek_v3": lambda: _deepseek(32, DEEPSEEK_YARN),
    "deepseek_v3_no_q_lora": lambda: _deepseek(None, dict(rope_type="default", rope_theta=10000.0)),
    "gpt_oss": lambda: GptOssConfig(
        **_COMMON,
        head_dim=16,
        rms_norm_eps=1e-5,
        intermediate_size=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=6,  # < len(PROMPT): the window is really exercised
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(GPT_OSS_YARN),
        attention_bias=True,
        swiglu_limit=1.5,  # the hub value is 7.0; 1.5 makes the clamp bite on hot weights
    ),
}


# ---- DeepSeek-V3.2 and GLM-5 (DSA: an indexer keeps index_topk=6 < 16 prompt keys per query, 16 indexer
# heads so that exact score ties at the top-k boundary are unlikely), Qwen3.5-MoE (gated DeltaNet layers on
# both sides of a gated full-attention layer; a vision tower that the engine must not read).
_DSA = dict(
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    index_topk=6,
    index_head_dim=16,
    index_n_heads=16,
)
#: Qwen3.5-MoE prompts must be longer than one DeltaNet prefill chunk (64 tokens)
QWEN3_5_PROMPT_LEN = 80


def _qwen3_5_moe() -> Qwen3_5MoeConfig:
    text = dict(
        **{k: v for k, v in _COMMON.items() if k not in ("tie_word_embeddings", "num_hidden_layers")},
        head_dim=32,
        rms_norm_eps=1e-6,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_hidden_layers=3,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[2, 1, 1], mrope_interleaved=True),
    )
    # a vision tower of ~10 MB (10x the language model), so that a test can see its bytes are never read
    vision = dict(depth=2, hidden_size=256, num_heads=4, intermediate_size=1024, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


CONFIGS.update({
    "deepseek_v32": lambda: DeepseekV32Config(
        **{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
        **_DSA,
        rms_norm_eps=1e-6,
        n_group=4,
        topk_group=2,
        mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters=dict(DEEPSEEK_YARN),
    ),
    "glm_moe_dsa": lambda: GlmMoeDsaConfig(
        **{**_COMMON, "num_hidden_layers": 4, "num_key_value_heads": 4},
        **{**_DSA, "moe_intermediate_size": 48},  # 32 leaves a near-tie (3e-4) in layer 1's expert choice
        rms_norm_eps=1e-5,
        n_group=1,
        topk_group=1,
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        indexer_types=["full", "shared", "full", "shared"],
        rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
    ),
    "qwen3_5_moe": _qwen3_5_moe,
})


def _model_class(config):
    """Qwen3.5-MoE is published as a vision-language model: build and load that, not its text-only head."""
    if config.model_type == "qwen3_5_moe":
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


_PER_EXPERT_RE = re.compile(
    r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$"
)
_PACKED_GPT_OSS_RE = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$"
)


# ----------------------------------------------------------------------------------------------------------------
# quiet transformers: nothing it says while building/loading these tiny models is actionable.
# Also run torch single-threaded: on this 2-core box, intra-op threads next to any other busy process make these
# tiny forwards up to 100x slower (spinning), and one thread keeps the numbers deterministic.
@contextlib.contextmanager
def _quiet():
    nthreads = torch.get_num_threads()
    torch.set_num_threads(1)
    tlog = logging.getLogger("transformers")
    old = tlog.level
    tlog.setLevel(logging.ERROR)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            # transformers/torch deprecation chatter only; anything else still surfaces
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(transformers|torch)(\.|$)")
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|torch)(\.|$)")
            yield
    finally:
        torch.set_num_threads(nthreads)
        tlog.setLevel(old)
        if bar:
            hf_logging.enable_progress_bar()


def build_from_config(make_config: Callable[[], Any], seed: int = 0) -> Any:
    """A tiny random model of ``make_config()`` (fp32, eager attention and experts), seeded, with
    ``reinit_hot``'s weights: what the family oracles (``oracle_glm4``, ``oracle_families``,
    ``oracle_granite``) build."""
    from transformers import AutoModelForCausalLM

    with _quiet():
        cfg = make_config()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32,
                                                 experts_implementation="eager")
    model.eval()
    reinit_hot(model, seed)
    return model


def save_in_layout(build: Callable[[], Any], layout: str, out_dir: Path) -> Path:
    """``build()``'s model saved to a new ``out_dir`` as ``per_expert`` (the original format) or
    ``packed`` (transformers 5's)."""
    if layout not in ("per_expert", "packed"):
        raise ValueError(f"unknown layout {layout!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    model = build()
    with _quiet():
        model.save_pretrained(out_dir, save_original_format=(layout == "per_expert"))
    return out_dir


def make_config(arch: str):
    if arch not in CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS + EXTRA_ARCHS}")
    with _quiet():
        return CONFIGS[arch]()


@torch.no_grad()
def reinit_hot(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter and persistent buffer from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    transposed = model.config.model_type == "gpt_oss"  # gpt-oss experts are [E, in, out]

    def randn(p):
        return torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)

    persistent = set(model.state_dict().keys())
    for n, p in list(model.named_parameters()) + list(model.named_buffers()):
        if n not in persistent:  # rotary inv_freq etc.
            continue
        if n.endswith("norm.weight") or "layernorm" in n:
            p.copy_(1 + 0.1 * randn(p))
        elif n.endswith("A_log"):  # Qwen3.5 DeltaNet decay rate: A = exp(A_log) ~ 0.14, a long memory
            p.copy_(-2 + 0.5 * randn(p))
        elif n.endswith("sinks"):
            p.copy_(randn(p))
        elif n.endswith("bias"):  # incl. e_score_correction_bias, gate_up_proj_bias, down_proj_bias
            p.copy_(0.1 * randn(p))
        elif "embed_tokens" in n:
            p.copy_(randn(p))
        elif p.dim() == 3:
            fan_in = p.shape[1] if transposed else p.shape[2]
            p.copy_(randn(p) / fan_in**0.5)
        elif p.dim() == 2:
            p.copy_(randn(p) / p.shape[1] ** 0.5)
        elif p.dim() == 1 and ".visual." in f".{n}":  # vision tower norms
            p.copy_(1 + 0.1 * randn(p))
        elif p.dim() > 3:  # the vision tower's patch convolution
            p.copy_(randn(p) / p[0].numel() ** 0.5)
        else:
            raise AssertionError(f"reinit_hot: no rule for {n} {tuple(p.shape)}")


def build_model(arch: str, seed: int = 0):
    """The in-memory transformers model (eager attention, fp32, hot weights) for ``arch``."""
    cfg = make_config(arch)
    torch.manual_seed(seed)
    with _quiet():
        model = _model_class(cfg).from_config(
            cfg, attn_implementation="eager", dtype=torch.float32, experts_implementation="eager"
        )
    model.eval()
    reinit_hot(model, seed)
    return model


def _is_gpt_oss(arch_or_type: str) -> bool:
    return arch_or_type == "gpt_oss"


def build_checkpoint(arch: str, layout: str, out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny hot-initialised model for ``arch`` and save it into ``out_dir`` (created; must not
    already contain a checkpoint) in ``layout`` ("per_expert" or "packed"). Returns ``out_dir``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(arch, seed)
    with _quiet():
        if layout == "packed":
            model.save_pretrained(out_dir, save_original_format=False)
        elif _is_gpt_oss(arch):
            model.save_pretrained(out_dir)  # always packed; the weights are rewritten below
            _rewrite_gpt_oss_per_expert(out_dir)
        elif arch in SHARDED_PER_EXPERT:
            model.save_pretrained(out_dir, max_shard_size=SHARDED_PER_EXPERT[arch])
        else:
            model.save_pretrained(out_dir)
    return out_dir


# ----------------------------------------------------------------------------------------------------------------
# safetensors helpers
def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint dir (single file or sharded), by on-disk name."""
    model_dir = Path(model_dir)
    idx = model_dir / "model.safetensors.index.json"
    if idx.exists():
        files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(model_dir / f), framework="pt") as sf:
            for k in sf.keys():
                if k in out:
                    raise AssertionError(f"duplicate tensor {k}")
                out[k] = sf.get_tensor(k)
    return out


def split_gpt_oss_experts(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Packed gpt-oss tensors -> the per-expert layout documented in the module docstring."""
    out: dict[str, torch.Tensor] = {}
    for name, t in packed.items():
        m = _PACKED_GPT_OSS_RE.match(name)
        if not m:
            out[name] = t.contiguous()
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            p = f"{prefix}.{e}"
            if kind == "gate_up_proj":  # [H, 2I] interleaved
                out[f"{p}.gate_proj.weight"] = t[e][:, 0::2].T.contiguous()
                out[f"{p}.up_proj.weight"] = t[e][:, 1::2].T.contiguous()
            elif kind == "gate_up_proj_bias":  # [2I] interleaved
                out[f"{p}.gate_proj.bias"] = t[e][0::2].contiguous()
                out[f"{p}.up_proj.bias"] = t[e][1::2].contiguous()
            elif kind == "down_proj":  # [I, H]
                out[f"{p}.down_proj.weight"] = t[e].T.contiguous()
            else:  # down_proj_bias [H]
                out[f"{p}.down_proj.bias"] = t[e].contiguous()
    return out


def pack_gpt_oss_experts(per_expert: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``split_gpt_oss_experts``."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in per_expert.items():
        m = _PER_EXPERT_RE.match(name)
        if not m:
            out[name] = t
            continue
        prefix, _, e, proj, kind = m.groups()
        groups.setdefault(prefix, {}).setdefault(int(e), {})[f"{proj}.{kind}"] = t
    for prefix, experts in groups.items():
        n = len(experts)
        if sorted(experts) != list(range(n)):
            raise AssertionError(f"{prefix}: expert ids {sorted(experts)} are not 0..{n - 1}")
        gu, gub, d, db = [], [], [], []
        for e in range(n):
            x = experts[e]
            g, u = x["gate_proj.weight"].T, x["up_proj.weight"].T  # [H, I]
            w = torch.empty(g.shape[0], 2 * g.shape[1], dtype=g.dtype)
            w[:, 0::2], w[:, 1::2] = g, u
            b = torch.empty(2 * g.shape[1], dtype=g.dtype)
            b[0::2], b[1::2] = x["gate_proj.bias"], x["up_proj.bias"]
            gu.append(w)
            gub.append(b)
            d.append(x["down_proj.weight"].T)
            db.append(x["down_proj.bias"])
        out[f"{prefix}.gate_up_proj"] = torch.stack(gu)
        out[f"{prefix}.gate_up_proj_bias"] = torch.stack(gub)
        out[f"{prefix}.down_proj"] = torch.stack(d).contiguous()
        out[f"{prefix}.down_proj_bias"] = torch.stack(db)
    return out


def _rewrite_gpt_oss_per_expert(model_dir: Path) -> None:
    if (model_dir / "model.safetensors.index.json").exists():
        raise AssertionError("gpt_oss per_expert rewrite expects a single-file save")
    packed = read_tensors(model_dir)
    save_file(split_gpt_oss_experts(packed), str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def is_gpt_oss_per_expert(model_dir: Path) -> bool:
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != "gpt_oss":
        return False
    return any(_PER_EXPERT_RE.match(k) for k in read_tensors(model_dir))


def verify_gpt_oss_per_expert(per_expert_dir: Path, packed_dir: Path) -> None:
    """Raise unless the per-expert gpt-oss checkpoint round-trips bit-exactly to the packed one (same names,
    shapes, dtypes and values after re-packing; split(packed) == per_expert as well; config.json identical)."""
    pe, pk = read_tensors(per_expert_dir), read_tensors(packed_dir)
    for a, b, what in ((pack_gpt_oss_experts(pe), pk, "pack(per_expert) vs packed"),
                       (split_gpt_oss_experts(pk), pe, "split(packed) vs per_expert")):
        if set(a) != set(b):
            raise AssertionError(f"{what}: names differ: {sorted(set(a) ^ set(b))[:8]}")
        for k in a:
            if a[k].shape != b[k].shape or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]):
                raise AssertionError(f"{what}: tensor {k} differs")
    c1 = json.loads((Path(per_expert_dir) / "config.json").read_text())
    c2 = json.loads((Path(packed_dir) / "config.json").read_text())
    if c1 != c2:
        raise AssertionError("config.json differs")


# ----------------------------------------------------------------------------------------------------------------
def write_legacy_rope_config(model_dir: Path) -> dict:
    """Rewrite ``model_dir/config.json`` in the pre-transformers-5 style: top-level ``rope_theta`` and no
    ``rope_parameters``; a non-default RoPE goes to ``rope_scaling`` with the old ``type`` key (as in
    DeepSeek-V3's hub config). Returns the new config dict."""
    path = Path(model_dir) / "config.json"
    top = json.loads(path.read_text())
    cfg = top.get("text_config", top)  # vision-language checkpoints (Qwen3.5-MoE) nest the language model's
    rp = cfg.pop("rope_parameters", None)
    if not isinstance(rp, dict) or "rope_theta" not in rp:
        raise ValueError(f"{path}: no single global rope_parameters dict to convert: {rp!r}")
    rp = dict(rp)
    cfg["rope_theta"] = rp.pop("rope_theta")
    if "partial_rotary_factor" in rp:  # Qwen3-Next style: a top-level field of the text config
        cfg["partial_rotary_factor"] = rp.pop("partial_rotary_factor")
    rope_type = rp.pop("rope_type", "default")
    if rope_type != "default" or rp.keys() <= {"mrope_section", "mrope_interleaved"} and rp:
        cfg["rope_scaling"] = {"type": rope_type, **rp}
    elif rp:
        raise ValueError(f"{path}: default rope with extra parameters {rp}")
    path.write_text(json.dumps(top, indent=2, sort_keys=True) + "\n")
    return top


# ----------------------------------------------------------------------------------------------------------------
_LOAD_PROBLEMS = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs", "conversion_errors")


def load_model(model_dir: Path, **config_overrides):
    """Load a checkpoint dir (either layout, incl. the hand-written gpt_oss per_expert one) into transformers:
    eager attention, eager experts, fp32. Raises if any tensor is missing, unexpected or mis-shaped.
    ``config_overrides`` go to ``AutoConfig.from_pretrained`` (e.g. ``sliding_window=64`` for a negative control)."""
    model_dir = Path(model_dir)
    with _quiet():
        config = AutoConfig.from_pretrained(model_dir, **config_overrides)
        if is_gpt_oss_per_expert(model_dir):
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation="eager", dtype=torch.float32, experts_implementation="eager"
            )
            model.load_state_dict(pack_gpt_oss_experts(read_tensors(model_dir)), strict=True)
        else:
            model = load_complete(_model_class(config), model_dir, config=config, experts_implementation="eager")
    return model.eval()


def load_complete(cls: Any, folder: Path, **kwargs: Any) -> Any:
    """``cls.from_pretrained(folder)`` in float32 with eager attention (``kwargs``: more of its options),
    refusing a load that left a weight missing, unexpected or mismatched."""
    with _quiet():
        model, info = cls.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32,
                                          output_loading_info=True, **kwargs)
    bad = {k: v for k, v in info.items() if v and k in _LOAD_PROBLEMS}
    if bad:
        raise AssertionError(f"{folder}: incomplete load: {bad}")
    return model.eval()


@dataclass(frozen=True)
class Reference:
    """Reference numerics for one checkpoint (all arrays float32, batch size 1).

    prompt_ids      the prompt, length T
    prefill_logits  [T, V]  logits at every prompt position, from one prefill pass
    decode_logits   [n_decode, V]  decode_logits[i] = logits at position T+i after feeding decode_tokens[i]
                    (one token per step, KV cache from the prefill and previous steps)
    decode_tokens   n_decode ints: decode_tokens[0] = argmax(prefill_logits[-1]),
                    decode_tokens[i] = argmax(decode_logits[i-1])
    greedy_tokens   n_decode+1 ints: the greedy continuation = decode_tokens + [argmax(decode_logits[-1])]
    greedy_margins  [n_decode+1]  top1 - top2 logit gap of each greedy choice (small => argmax fragile)
    model_type      config.json's model_type
    """

    prompt_ids: list[int]
    prefill_logits: np.ndarray
    decode_logits: np.ndarray
    decode_tokens: list[int]
    greedy_tokens: list[int]
    greedy_margins: np.ndarray
    model_type: str = ""

    @property
    def sequence_ids(self) -> list[int]:
        """prompt + fed decode tokens; a single prefill over these should reproduce ``all_logits``."""
        return list(self.prompt_ids) + list(self.decode_tokens)

    @property
    def all_logits(self) -> np.ndarray:
        """[T + n_decode, V]: prefill_logits then decode_logits."""
        return np.concatenate([self.prefill_logits, self.decode_logits], axis=0)


def _top2_gap(logits: torch.Tensor) -> float:
    v = torch.topk(logits.float(), 2).values
    return float(v[0] - v[1])


@torch.inference_mode()
def run_model(model, prompt_ids: list[int], n_decode: int = 8) -> Reference:
    """Prefill + ``n_decode`` greedy KV-cache decode steps on an already loaded model."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    V = model.config.get_text_config().vocab_size
    if not all(0 <= int(t) < V for t in prompt_ids):
        raise ValueError("prompt id out of vocab")
    with _quiet():
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([[int(t) for t in prompt_ids]], dtype=torch.long)
        prefill = model(input_ids=ids, cache=cache, use_cache=True).logits[0].float()
        last = prefill[-1]
        toks, margins, dec = [], [], []
        for _ in range(n_decode):
            tok = int(torch.argmax(last))
            toks.append(tok)
            margins.append(_top2_gap(last))
            out = model(input_ids=torch.tensor([[tok]], dtype=torch.long), cache=cache, use_cache=True)
            last = out.logits[0, -1].float()
            dec.append(last)
        if cache.get_seq_length() != len(prompt_ids) + n_decode:
            raise AssertionError(f"cache length {cache.get_seq_length()} != {len(prompt_ids) + n_decode}")
    greedy = toks + [int(torch.argmax(last))]
    margins.append(_top2_gap(last))
    return Reference(
        prompt_ids=[int(t) for t in prompt_ids],
        prefill_logits=prefill.numpy().astype(np.float32),
        decode_logits=(torch.stack(dec).numpy() if dec else np.zeros((0, V))).astype(np.float32),
        decode_tokens=toks,
        greedy_tokens=greedy,
        greedy_margins=np.asarray(margins, dtype=np.float32),
        model_type=model.config.model_type,
    )


def reference_run(model_dir: Path, prompt_ids: list[int], n_decode: int = 8) -> Reference:
    """Load ``model_dir`` with transformers (eager, fp32) and compute the reference (see ``Reference``)."""
    return run_model(load_model(model_dir), prompt_ids, n_decode)


# ----------------------------------------------------------------------------------------------------------------
# self-check helpers: how strong is the oracle?
def _decoder_layers(model):
    """The decoder layers (a vision-language model keeps them in its language model)."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


def _capture_mlp_inputs(model, ids: list[int]) -> dict[int, torch.Tensor]:
    """Input of every decoder layer's MLP (= post_attention_layernorm output), [T, H], one full prefill."""
    got: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(_decoder_layers(model)):
        def hook(mod, args, kwargs, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            got[i] = x.detach().reshape(-1, x.shape[-1]).clone()
        hooks.append(layer.mlp.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad(), _quiet():
            model(input_ids=torch.tensor([list(ids)]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return got


def _router(model, layer) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
    """(kind, weight, bias) of a layer's router, or None for a dense layer."""
    mt = model.config.model_type
    mlp = layer.mlp
    if mt == "gpt_oss":
        return "gpt_oss", mlp.router.weight, mlp.router.bias
    if not hasattr(mlp, "experts"):
        return None
    if mt in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        return "sigmoid", mlp.gate.weight, mlp.gate.e_score_correction_bias
    return "softmax", mlp.gate.weight, None


def router_stats(model, ids: list[int]) -> dict[int, dict[str, float]]:
    """Per MoE layer, on the tokens ``ids`` (one prefill):
    topk_mass     mean over tokens of the share of the k chosen experts in the router's distribution
                  (softmax routers and gpt-oss: softmax over all E logits; deepseek: sigmoid scores / their sum)
    uniform_mass  k / E, what uniform routing would give
    n_distinct    number of distinct experts chosen across the tokens
    min_margin    smallest gap, over tokens, between the k-th and (k+1)-th selection score (deepseek: also the
                  group-selection gap), i.e. how robust the top-k choice is to ~1e-6 numerical noise."""
    cfg = model.config.get_text_config()
    k = cfg.num_experts_per_tok
    xs = _capture_mlp_inputs(model, ids)
    out: dict[int, dict[str, float]] = {}
    for i, layer in enumerate(_decoder_layers(model)):
        r = _router(model, layer)
        if r is None:
            continue
        kind, w, b = r
        with torch.no_grad():
            logits = xs[i].float() @ w.float().T
            E = logits.shape[-1]
            if kind == "gpt_oss":
                logits = logits + b.float()
            if kind == "sigmoid":
                s = torch.sigmoid(logits)
                chosen, margin = _deepseek_select(cfg, s + b.float())
                mass = (s.gather(1, chosen).sum(-1) / s.sum(-1)).mean()
            else:
                p = torch.softmax(logits, -1)
                top = torch.topk(logits, k + 1, dim=-1).values
                chosen = torch.topk(logits, k, dim=-1).indices
                margin = (top[:, k - 1] - top[:, k]).min()
                mass = p.gather(1, chosen).sum(-1).mean()
        out[i] = dict(topk_mass=float(mass), uniform_mass=k / E, n_distinct=float(len(torch.unique(chosen))),
                      min_margin=float(margin))
    return out


def _deepseek_select(cfg, biased: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc group-limited top-k on biased scores [T, E] -> (indices [T, k], min selection margin)."""
    T, E = biased.shape
    G, TG, k = cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    gs = biased.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)  # [T, G]
    gtop = gs.topk(TG + 1 if TG < G else TG, dim=-1).values
    gmargin = (gtop[:, TG - 1] - gtop[:, TG]).min() if TG < G else torch.tensor(float("inf"))
    gidx = gs.topk(TG, dim=-1).indices
    mask = torch.zeros(T, G, dtype=torch.bool).scatter_(1, gidx, True)
    mask = mask[:, :, None].expand(T, G, E // G).reshape(T, E)
    masked = biased.masked_fill(~mask, float("-inf"))
    top = masked.topk(k + 1, dim=-1).values if k < TG * E // G else masked.topk(k, dim=-1).values
    emargin = (top[:, k - 1] - top[:, k]).min() if top.shape[1] > k else torch.tensor(float("inf"))
    return masked.topk(k, dim=-1).indices, torch.minimum(gmargin, emargin)


def deepseek_group_routing_stats(model, ids: list[int]) -> dict[int, float]:
    """Per MoE layer: fraction of tokens whose group-limited expert set differs from plain top-k over all E
    experts (both on sigmoid + e_score_correction_bias)."""
    cfg = model.config
    xs = _capture_mlp_inputs(model, ids)
    out = {}
    for i, layer in enumerate(_decoder_layers(model)):
        r = _router(model, layer)
        if r is None:
            continue
        _, w, b = r
        with torch.no_grad():
            biased = torch.sigmoid(xs[i].float() @ w.float().T) + b.float()
            grouped, _ = _deepseek_select(cfg, biased)
            plain = biased.topk(cfg.num_experts_per_tok, dim=-1).indices
            differ = [set(grouped[t].tolist()) != set(plain[t].tolist()) for t in range(biased.shape[0])]
        out[i] = float(np.mean(differ))
    return out


def gpt_oss_clamp_stats(model, ids: list[int]) -> dict[int, dict[str, float]]:
    """Per layer of a gpt-oss model: over the (token, routed expert) pairs of a prefill on ``ids``, the fraction
    of gate pre-activations above ``swiglu_limit`` (gate is clamped from above only) and of up pre-activations
    outside [-limit, limit]."""
    cfg = model.config
    lim = cfg.swiglu_limit
    xs = _capture_mlp_inputs(model, ids)
    out = {}
    for i, layer in enumerate(_decoder_layers(model)):
        mlp = layer.mlp
        with torch.no_grad():
            x = xs[i].float()
            logits = x @ mlp.router.weight.T + mlp.router.bias
            idx = torch.topk(logits, cfg.num_experts_per_tok, dim=-1).indices  # [T, k]
            W, B = mlp.experts.gate_up_proj, mlp.experts.gate_up_proj_bias  # [E, H, 2I], [E, 2I]
            gu = torch.einsum("th,tkhj->tkj", x, W[idx]) + B[idx]
            gate, up = gu[..., 0::2], gu[..., 1::2]
        out[i] = dict(gate_above=float((gate > lim).float().mean()), up_outside=float((up.abs() > lim).float().mean()),
                      limit=float(lim))
    return out
