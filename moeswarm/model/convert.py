"""Weight converters: checkpoint tensors -> the engine's canonical tensors, in one pass.

Checkpoints store experts in several layouts (seed 004): one 2-D tensor per expert
(``experts.E.w1/w2/w3`` in Mixtral, ``experts.E.{gate,up,down}_proj`` elsewhere), packed
per layer in transformers 5 (``experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), or
gpt-oss's transposed, interleaved ``gate_up_proj [E, H, 2I]`` with biases.  A ``Rule`` is a key
pattern plus a chain of ops; ops only take views (unstack, chunk, de-interleave, transpose), so
converting never reads a tensor's bytes: the result is the same memory map, re-sliced.

Canonical names use the ``nn.Linear`` orientation ``[out, in]`` everywhere:

* ``embed``, ``final_norm``, ``lm_head``
* ``{L}.attn_norm``, ``{L}.mlp_norm``, ``{L}.attn.{q,k,v,o}[_bias]``, ``{L}.attn.{q,k}_norm``,
  ``{L}.attn.sinks``, MLA: ``{L}.attn.{q_a,q_a_norm,q_b,kv_a,kv_a_norm,kv_b}``
* ``{L}.mlp.{gate,up,down}`` (dense layers), ``{L}.router``, ``{L}.router_bias``,
  ``{L}.router_score_bias``, ``{L}.shared.{gate,up,down}``, ``{L}.shared_gate``
* ``{L}.experts.{E}.{gate,up,down}[_bias]``: gate/up ``[I, H]``, down ``[H, I]``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ._safetensors import SafetensorsFile, TensorRef

Fields = dict[str, str]
Item = tuple[Fields, np.ndarray]
Op = Callable[[Iterable[Item]], Iterator[Item]]


def unstack(field: str) -> Op:
    """``[E, ...]`` -> E tensors ``[...]``, numbering them in ``field``."""

    def op(items: Iterable[Item]) -> Iterator[Item]:
        for fields, a in items:
            for i in range(a.shape[0]):
                yield {**fields, field: str(i)}, a[i]

    return op


def chunk(field: str, names: tuple[str, ...], axis: int = 0) -> Op:
    """Split into ``len(names)`` equal contiguous parts along ``axis`` (gate rows, then up rows)."""

    def op(items: Iterable[Item]) -> Iterator[Item]:
        for fields, a in items:
            for name, part in zip(names, np.split(a, len(names), axis=axis)):
                yield {**fields, field: name}, part

    return op


def deinterleave(field: str, names: tuple[str, ...], axis: int = 0) -> Op:
    """Take every n-th slice along ``axis``: gpt-oss stores gate at 0::2 and up at 1::2."""

    def op(items: Iterable[Item]) -> Iterator[Item]:
        n = len(names)
        for fields, a in items:
            for i, name in enumerate(names):
                index = [slice(None)] * a.ndim
                index[axis] = slice(i, None, n)
                yield {**fields, field: name}, a[tuple(index)]

    return op


def transpose() -> Op:
    """Swap the last two axes (input-major -> ``[out, in]``)."""

    def op(items: Iterable[Item]) -> Iterator[Item]:
        for fields, a in items:
            yield fields, np.swapaxes(a, -1, -2)

    return op


@dataclass(frozen=True)
class Rule:
    pattern: str  # regex over the checkpoint key, with named groups (L = layer, E = expert, ...)
    target: str  # canonical name template, filled from the groups and the ops' fields
    ops: tuple[Op, ...] = ()

    def compiled(self) -> re.Pattern[str]:
        return re.compile(self.pattern)


_L = r"model\.layers\.(?P<L>\d+)\."
_BACKBONE = (
    Rule(r"model\.embed_tokens\.weight", "embed"),
    Rule(r"model\.norm\.weight", "final_norm"),
    Rule(r"lm_head\.weight", "lm_head"),
    Rule(_L + r"input_layernorm\.weight", "{L}.attn_norm"),
    Rule(_L + r"post_attention_layernorm\.weight", "{L}.mlp_norm"),
    Rule(_L + r"self_attn\.(?P<p>[qkvo])_proj\.weight", "{L}.attn.{p}"),
    Rule(_L + r"self_attn\.(?P<p>[qkvo])_proj\.bias", "{L}.attn.{p}_bias"),
    Rule(_L + r"self_attn\.(?P<p>[qk])_norm\.weight", "{L}.attn.{p}_norm"),
    Rule(_L + r"self_attn\.sinks", "{L}.attn.sinks"),
    Rule(_L + r"self_attn\.(?P<p>q_a|q_b|kv_a|kv_b)_proj(?:_with_mqa)?\.weight", "{L}.attn.{p}"),
    Rule(_L + r"self_attn\.(?P<p>q_a|kv_a)_layernorm\.weight", "{L}.attn.{p}_norm"),
    Rule(_L + r"mlp\.(?P<p>gate|up|down)_proj\.weight", "{L}.mlp.{p}"),
    Rule(_L + r"mlp\.shared_experts?\.(?P<p>gate|up|down)_proj\.weight", "{L}.shared.{p}"),
    Rule(_L + r"mlp\.shared_expert_gate\.weight", "{L}.shared_gate"),
    Rule(_L + r"(?:mlp|block_sparse_moe)\.gate\.weight", "{L}.router"),
    Rule(_L + r"mlp\.gate\.e_score_correction_bias", "{L}.router_score_bias"),
    Rule(_L + r"mlp\.router\.weight", "{L}.router"),
    Rule(_L + r"mlp\.router\.bias", "{L}.router_bias"),
)
_E = _L + r"(?:mlp|block_sparse_moe)\.experts\."
_PER_EXPERT = (
    # Mixtral hub names: w1 = gate, w3 = up, w2 = down
    Rule(_E + r"(?P<E>\d+)\.w1\.weight", "{L}.experts.{E}.gate"),
    Rule(_E + r"(?P<E>\d+)\.w3\.weight", "{L}.experts.{E}.up"),
    Rule(_E + r"(?P<E>\d+)\.w2\.weight", "{L}.experts.{E}.down"),
    Rule(_E + r"(?P<E>\d+)\.(?P<p>gate|up|down)_proj\.weight", "{L}.experts.{E}.{p}"),
    Rule(_E + r"(?P<E>\d+)\.(?P<p>gate|up|down)_proj\.bias", "{L}.experts.{E}.{p}_bias"),
)
_PACKED = (  # transformers 5 runtime layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    Rule(_E + r"gate_up_proj", "{L}.experts.{E}.{p}", (unstack("E"), chunk("p", ("gate", "up")))),
    Rule(_E + r"down_proj", "{L}.experts.{E}.down", (unstack("E"),)),
)
_PACKED_GPT_OSS = (  # gate_up_proj [E, H, 2I] interleaved, down_proj [E, I, H], with biases
    Rule(_E + r"gate_up_proj", "{L}.experts.{E}.{p}", (unstack("E"), transpose(), deinterleave("p", ("gate", "up")))),
    Rule(_E + r"gate_up_proj_bias", "{L}.experts.{E}.{p}_bias", (unstack("E"), deinterleave("p", ("gate", "up")))),
    Rule(_E + r"down_proj", "{L}.experts.{E}.down", (unstack("E"), transpose())),
    Rule(_E + r"down_proj_bias", "{L}.experts.{E}.down_bias", (unstack("E"),)),
)

_MXFP4_GPT_OSS = (  # gpt-oss as published: gate_up_proj_blocks [E, 2I, H/32, 16] rows interleaved, down [E, H, ..]
    # (``_stored.combine_stored`` has made each _blocks + _scales pair one [E, out, in] StoredTensor)
    Rule(_E + r"gate_up_proj_blocks", "{L}.experts.{E}.{p}", (unstack("E"), deinterleave("p", ("gate", "up")))),
    Rule(_E + r"down_proj_blocks", "{L}.experts.{E}.down", (unstack("E"),)),
)

RULES: dict[str, tuple[Rule, ...]] = {
    arch: _BACKBONE + _PER_EXPERT + (_PACKED_GPT_OSS + _MXFP4_GPT_OSS if arch == "gpt_oss" else _PACKED)
    for arch in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
}


# ---------------------------------------------------------------- DSA and Qwen3.5-MoE


def plus_one() -> Op:
    """``1 + w`` in float32: Qwen3.5's RMSNorms scale by ``1 + weight`` (a small copy, not a view)."""

    def op(items: Iterable[Item]) -> Iterator[Item]:
        for fields, a in items:
            yield fields, a.astype(np.float32) + np.float32(1.0)

    return op


def neg_exp() -> Op:
    """``-exp(a)`` in float32 (Qwen3.5's ``A_log`` -> the decay rate ``A``; llama.cpp's ``ssm_a``)."""

    def op(items: Iterable[Item]) -> Iterator[Item]:
        for fields, a in items:
            yield fields, -np.exp(a.astype(np.float32))

    return op


def squeeze(axis: int) -> Op:
    """Drop a length-1 axis (a depthwise ``Conv1d`` weight ``[C, 1, K]`` -> ``[C, K]``)."""

    def op(items: Iterable[Item]) -> Iterator[Item]:
        for fields, a in items:
            yield fields, np.squeeze(a, axis=axis)

    return op


_INDEXER = (  # DeepSeek-V3.2 / GLM-5 lightning indexer, beside the MLA tensors
    Rule(_L + r"self_attn\.indexer\.wq_b\.weight", "{L}.attn.idx_q_b"),
    Rule(_L + r"self_attn\.indexer\.wk\.weight", "{L}.attn.idx_k"),
    Rule(_L + r"self_attn\.indexer\.k_norm\.weight", "{L}.attn.idx_k_norm"),
    Rule(_L + r"self_attn\.indexer\.k_norm\.bias", "{L}.attn.idx_k_norm_bias"),
    Rule(_L + r"self_attn\.indexer\.weights_proj\.weight", "{L}.attn.idx_w"),
)


def _language_model(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """The same rules, also under a vision-language checkpoint's ``model.language_model.`` prefix; the
    vision tower's keys (``model.visual.*``) match nothing, so their bytes are never touched."""
    return tuple(Rule(r.pattern.replace(r"model\.", r"model\.(?:language_model\.)?", 1), r.target, r.ops) for r in rules)


_QWEN3_5 = _language_model((
    # zero-centred RMSNorms (weight + 1); listed first so that they win over the generic rules
    Rule(r"model\.norm\.weight", "final_norm", (plus_one(),)),
    Rule(_L + r"input_layernorm\.weight", "{L}.attn_norm", (plus_one(),)),
    Rule(_L + r"post_attention_layernorm\.weight", "{L}.mlp_norm", (plus_one(),)),
    Rule(_L + r"self_attn\.(?P<p>[qk])_norm\.weight", "{L}.attn.{p}_norm", (plus_one(),)),
    Rule(_L + r"linear_attn\.in_proj_(?P<p>qkv|z|b|a)\.weight", "{L}.attn.{p}"),
    Rule(_L + r"linear_attn\.conv1d\.weight", "{L}.attn.conv", (squeeze(1),)),
    Rule(_L + r"linear_attn\.dt_bias", "{L}.attn.dt_bias"),
    Rule(_L + r"linear_attn\.A_log", "{L}.attn.A", (neg_exp(),)),  # the decay rate A = -exp(A_log), as llama.cpp
    Rule(_L + r"linear_attn\.norm\.weight", "{L}.attn.norm"),
    Rule(_L + r"linear_attn\.out_proj\.weight", "{L}.attn.out"),
) + _BACKBONE + _PER_EXPERT + _PACKED)

RULES.update(
    deepseek_v32=_INDEXER + RULES["deepseek_v3"],
    glm_moe_dsa=_INDEXER + RULES["deepseek_v3"],
    qwen3_5_moe=_QWEN3_5,
)
_EXPERT_KEY = re.compile(r"^(\d+)\.experts\.(\d+)\.")


@dataclass
class Converted:
    tensors: dict[str, np.ndarray]  # canonical name -> view into the checkpoint's memory map
    sources: dict[str, TensorRef]  # canonical name -> where it came from (for error messages)
    unmatched: list[str]  # checkpoint keys no rule claimed (ignored)


def convert(
    arch: str,
    keys: dict[str, tuple[SafetensorsFile, str]],
    *,
    keep: Callable[[int, int], bool] | None = None,
    num_layers: int | None = None,
    num_experts: int | None = None,
    extra: tuple[Rule, ...] = (),
) -> Converted:
    """One pass over the checkpoint keys.  ``keep(layer, expert)`` drops experts a node does not hold;
    ``extra`` rules are tried first (the MTP layers' own tensors, ``model/mtp.py``).
    ``num_experts``, if given, reaches the ops as the field ``n`` (DBRX stores a layer's experts as one
    flat ``[E * I, H]`` tensor, which only the expert count splits)."""
    rules = [(r, r.compiled()) for r in extra + RULES[arch]]
    out = Converted({}, {}, [])
    for key, (file, inner) in keys.items():
        for rule, rx in rules:
            m = rx.fullmatch(key)
            if m is None:
                continue
            groups = m.groupdict()
            if num_experts is not None:
                groups.setdefault("n", str(num_experts))
            if num_layers is not None and "L" in groups and int(groups["L"]) >= num_layers:
                break  # e.g. DeepSeek-V3's multi-token-prediction layer when it is not read
            if keep is not None and "E" in groups and not keep(int(groups["L"]), int(groups["E"])):
                break
            items: Iterable[Item] = [(groups, file.tensor(inner))]
            for op in rule.ops:
                items = op(items)
            for fields, array in items:
                name = rule.target.format(**fields)
                if keep is not None:
                    e = _EXPERT_KEY.match(name)
                    if e and not keep(int(e.group(1)), int(e.group(2))):
                        continue
                out.tensors[name] = array
                out.sources[name] = TensorRef(file.path, key)
            break
        else:
            out.unmatched.append(key)
    return out
