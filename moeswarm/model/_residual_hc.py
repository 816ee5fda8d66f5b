"""DeepSeek-V4's residual form (``ModelConfig.residual_form == "hyper"``): manifold-constrained
hyper-connections, read from transformers 5.24's ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``.

The stream is ``hc_mult`` copies of the hidden state, (B, T, n, H).  Before each block (site "attn"
or "mlp") the n streams, flattened and scaled to unit RMS, project through ``{L}.hc_{site}_fn`` into
pre (n), post (n) and comb (n x n) weights (each times its ``scale``, plus its ``base``):
pre = sigmoid(.) + eps collapses the streams into the block's input; after the block the streams
become post_k * out + sum_j comb[j, k] * stream_j, with comb a row softmax (+ eps) made doubly
stochastic by ``hc_sinkhorn_iters`` Sinkhorn-Knopp normalisations (columns first).  The ``hc_head``
collapses the last stream the way pre does, before the final norm.

Why a residual form rather than a branch in the decoder layer: the stream's shape changes from
(B, T, H) to (B, T, n, H) for the whole pass (embeddings to final norm), and the blocks read and
join it through learned mixes; ``Model.layer`` asks the form for each block's input and hands it the
output, so the attention kinds, routers and experts (a swarm's remote experts too) see (B, T, H) as
for any other family.
"""

from __future__ import annotations

import numpy as np

from ._config_dsv4 import Dsv4Settings
from .attention import linear
from .config import ModelConfig
from .experts import f32, sigmoid
from .transformer import RESIDUAL_FORMS
from .weights import EXTRA_SHAPES, Shapes, Weights


class HyperConnections:
    def __init__(self, cfg: ModelConfig, weights: Weights) -> None:
        s: Dsv4Settings = cfg.family
        self.w, self.n, self.iters, self.eps, self.norm_eps = weights, s.hc_mult, s.hc_sinkhorn_iters, s.hc_eps, cfg.rms_norm_eps

    def expand(self, x: np.ndarray) -> np.ndarray:
        return np.repeat(x[:, :, None, :], self.n, axis=2)  # (B, T, n, H)

    def _mix(self, x: np.ndarray, fn: np.ndarray) -> np.ndarray:
        flat = x.reshape(*x.shape[:2], -1)  # (B, T, n * H)
        flat = flat / np.sqrt(np.mean(np.square(flat), axis=-1, keepdims=True) + np.float32(self.norm_eps))
        return linear(flat, fn)

    def enter(self, layer: int, site: str, x: np.ndarray) -> tuple[np.ndarray, object]:
        n, eps, p = self.n, np.float32(self.eps), f"{layer}.hc_{site}_"
        mix = self._mix(x, self.w[p + "fn"])  # (B, T, (2 + n) * n)
        base, scale = f32(self.w[p + "base"]), f32(self.w[p + "scale"])
        pre = sigmoid(mix[..., :n] * scale[0] + base[:n]) + eps
        post = 2 * sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = (mix[..., 2 * n :] * scale[2] + base[2 * n :]).reshape(*mix.shape[:2], n, n)
        comb = np.exp(comb - comb.max(axis=-1, keepdims=True))
        comb = comb / comb.sum(axis=-1, keepdims=True) + eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        return (pre[..., None] * x).sum(axis=2).astype(np.float32), (post, comb)

    def leave(self, layer: int, site: str, x: np.ndarray, out: np.ndarray, held: object) -> np.ndarray:
        post, comb = held  # type: ignore[misc]
        return (post[..., None] * out[:, :, None, :] + np.einsum("btjk,btjd->btkd", comb, x)).astype(np.float32)

    def collapse(self, x: np.ndarray, head: str = "") -> np.ndarray:
        """(B, T, n, H) -> (B, T, H) by the ``{head}hc_head_*`` tensors (an MTP layer has its own)."""
        mix = self._mix(x, self.w[head + "hc_head_fn"])  # (B, T, n)
        pre = sigmoid(mix * f32(self.w[head + "hc_head_scale"])[0] + f32(self.w[head + "hc_head_base"])) + np.float32(self.eps)
        return (pre[..., None] * x).sum(axis=2).astype(np.float32)


def dsv4_shapes(cfg: ModelConfig) -> Shapes:
    """DeepSeek-V4's tensors beyond the generic ones: hyper-connections, and per MoE layer the
    hash table (hash-routed layers) or the correction bias (learned ones)."""
    s: Dsv4Settings = cfg.family
    n, H = s.hc_mult, cfg.hidden_size
    shapes: Shapes = {"hc_head_fn": (n, n * H), "hc_head_base": (n,), "hc_head_scale": (1,)}
    for L in range(cfg.all_layers):  # the MTP layers' too (model/mtp.py)
        for site in ("attn", "mlp"):
            p = f"{L}.hc_{site}_"
            shapes.update({p + "fn": ((2 + n) * n, n * H), p + "base": ((2 + n) * n,), p + "scale": (3,)})
        if s.hash_layers[L]:
            shapes[f"{L}.router_table"] = (cfg.vocab_size, cfg.top_k)
        else:
            shapes[f"{L}.router_score_bias"] = (cfg.num_experts,)
    return shapes


RESIDUAL_FORMS["hyper"] = HyperConnections
EXTRA_SHAPES["deepseek_v4"] = dsv4_shapes
