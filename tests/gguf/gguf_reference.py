"""The reference path for quantized GGUF files: every quantized weight decoded once by gguf-py (llama.cpp's
own Python codec), then plain float32 numpy."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from moeswarm.model.gguf import QuantizedTensor
from moeswarm.model.transformer import Model
from moeswarm.model.weights import Weights

# The kernels quantize activations to int8 per block (as llama.cpp's Q8 activations), one rounding of
# amax/254 per block; through 2-3 layers that measured 0.7-1.3 % of the largest logit. A wrong block layout or
# scale gives errors of the logits' own size.
LOGIT_TOL = 0.03


def dequantised(w: Weights) -> Model:
    """The reference path: every quantized weight decoded once by gguf-py, then float32 numpy."""
    dense = {k: np.asarray(a) if isinstance(a, QuantizedTensor) else a for k, a in w.tensors.items()}
    experts = {L: {e: replace(x, **{p: np.asarray(getattr(x, p)) for p in ("gate", "up", "down")})
                   for e, x in layer.items()} for L, layer in w.experts.items()}
    return Model(replace(w, tensors=dense, experts=experts))
