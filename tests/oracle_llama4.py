"""Test-side oracle for Llama 4 (``llama4``, ``llama4_text``): tiny hot-initialised checkpoints built by
transformers 5.24, and reference logits from transformers (fp32, eager attention).  Test-only (imports
torch + transformers); reuses ``oracle.py``'s prompt, hot init and reference run.

The text model (``CONFIG``): vocab 512, hidden 64, 4 heads of 16 (2 kv heads), 4 layers, chosen so that
every mechanism moves the logits (``tests/llama4/test_llama4_oracle.py`` switches each off):

* ``no_rope_layer_interval=2``: layers 0 and 2 RoPE (interleaved pairs, ``llama3`` scaling with
  ``original_max_position_embeddings=16``, ``factor=8``, ``low/high_freq_factor`` 1 / 4, so that the
  8 frequencies fall in all three of its bands), L2 q/k norm, chunked attention in chunks of 5 (the
  16-token prompt and 8 decode steps cross four chunk borders); layers 1 and 3 NoPE, full attention,
  temperature tuning with ``floor_scale=4``, ``attn_scale=0.5`` (scales 1 ... 1.9 over 24 positions);
* ``interleave_moe_layer_step=2``: layers 1 and 3 MoE (8 experts 32 wide, top-2: the published
  models route top-1; two choices test the input scaling per choice), a shared expert as wide;
  layers 0 and 2 dense, ``intermediate_size_mlp=128``.

Layouts: ``text`` is ``Llama4ForCausalLM.save_pretrained`` (``model_type: llama4_text``, ``model.*``);
``vision`` is ``Llama4ForConditionalGeneration``'s (``model_type: llama4``, the same text model as
``text_config`` and under ``language_model.*``, beside a one-layer vision tower the engine does not read).
Both store the experts as transformers runs them (``gate_up_proj [E, H, 2I]``), as the hub does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
import torch
from oracle import PROMPT, Reference, _quiet, run_model  # noqa: F401  (re-exported)
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    Llama4Config,
    Llama4ForCausalLM,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
)

LAYOUTS = ("text", "vision")

TEXT: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
    intermediate_size=32, intermediate_size_mlp=128, num_local_experts=8, num_experts_per_tok=2,
    interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=5, floor_scale=4, attn_scale=0.5,
    max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="llama3", rope_theta=10_000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=16),
)
VISION: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                              vision_output_dim=64, image_size=28, patch_size=14, projector_input_dim=64,
                              projector_output_dim=64)


def CONFIG() -> Llama4TextConfig:  # noqa: N802 - a config factory, as oracle_families.CONFIGS
    return Llama4TextConfig(**TEXT)


def build_model(layout: str = "text", seed: int = 0) -> Any:
    with _quiet():
        torch.manual_seed(seed)
        if layout == "text":
            model = Llama4ForCausalLM._from_config(CONFIG(), attn_implementation="eager", dtype=torch.float32)
        else:
            model = Llama4ForConditionalGeneration._from_config(
                Llama4Config(text_config=TEXT, vision_config=VISION), attn_implementation="eager",
                dtype=torch.float32)
    model.eval()
    oracle.reinit_hot(model if layout == "text" else model.language_model, seed)  # the vision tower stays as built
    return model


def build_checkpoint(layout: str, out_dir: Path, seed: int = 0) -> Path:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    model = build_model(layout, seed)
    with _quiet():
        model.save_pretrained(out_dir)
    return out_dir


def load(folder: Path) -> Any:
    """The checkpoint as transformers loads it (fp32, eager), refusing an incomplete load."""
    cls = AutoModelForImageTextToText if '"llama4"' in (Path(folder) / "config.json").read_text() else AutoModelForCausalLM
    return oracle.load_complete(cls, folder)


def reference_run(folder: Path, prompt: list[int], n_decode: int = 8) -> Reference:
    """``oracle.run_model`` on the loaded text model (a ``Llama4ForConditionalGeneration``'s own forward
    fails on text-only input in transformers 5.24: it reads ``image_outputs`` from the text model's output)."""
    model = load(folder)
    return run_model(getattr(model, "language_model", model), prompt, n_decode)
