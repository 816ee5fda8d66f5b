"""Tiny checkpoints for llama.cpp's converter: a family oracle's (tests/oracle_families.py) config with what
llama.cpp's architecture cannot express switched off.  ``dots1``: llama.cpp's dots1 has no sliding-window
layers, so every layer attends fully (``layer_types`` all ``full_attention``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
import oracle_families
from oracle import PROMPT, reference_run  # noqa: F401  (OracleCheckpoints reads them here)

OVERRIDES: dict[str, dict[str, Any]] = {
    "ernie4_5_moe": {"moe_layer_interval": 1, "moe_layer_end_index": -1, "num_key_value_heads": 4},
    "dots1": {"sliding_window": None, "layer_types": ["full_attention"] * 3, "num_key_value_heads": 4,
              "attention_bias": False},
}


def build_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> Path:
    def config() -> Any:
        cfg = oracle_families.CONFIGS[arch]()  # rebuilt, so that what the config derives follows the overrides
        return type(cfg).from_dict({**cfg.to_dict(), **OVERRIDES[arch]})

    return oracle.save_in_layout(lambda: oracle.build_from_config(config, seed), "per_expert", out_dir)
