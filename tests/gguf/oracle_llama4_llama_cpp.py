"""A tiny Llama 4 (``Llama4ForConditionalGeneration``, the class llama.cpp's converter takes) whose text model
uses the values llama.cpp fixes instead of storing: attention chunks of 8192 tokens, NoPE every 4th layer,
temperature floor 8192 and scale 0.1, q/k norm.  Everything else is tests/oracle_llama4.py's, but for the
``llama3`` RoPE scaling's bands: the original context 1024, high factor 16, so that two frequencies fall
between the bands and llama.cpp's ``rope_freqs`` determines the scaling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
import oracle_llama4
import torch
from oracle import PROMPT  # noqa: F401  (OracleCheckpoints reads it here)
from transformers import Llama4Config, Llama4ForConditionalGeneration

TEXT: dict[str, Any] = {
    **oracle_llama4.TEXT, "attention_chunk_size": 8192, "no_rope_layer_interval": 4, "floor_scale": 8192,
    "attn_scale": 0.1, "use_qk_norm": True,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 16.0, "original_max_position_embeddings": 1024},
}


def build_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    with oracle._quiet():
        torch.manual_seed(seed)
        model = Llama4ForConditionalGeneration._from_config(
            Llama4Config(text_config=TEXT, vision_config=oracle_llama4.VISION), attn_implementation="eager",
            dtype=torch.float32)
        model.eval()
        oracle.reinit_hot(model.language_model, seed)
        model.save_pretrained(out_dir)
    return out_dir


reference_run = oracle_llama4.reference_run
