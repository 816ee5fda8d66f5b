"""Tiny checkpoints for llama.cpp's converter: a family oracle's (tests/oracle_families.py) config with what
llama.cpp's architecture cannot express switched off.  ``dots1``: llama.cpp's dots1 has no sliding-window
layers, so every layer attends fully (``layer_types`` all ``full_attention``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
import oracle_families
import oracle_mistral4
from oracle import PROMPT  # noqa: F401  (OracleCheckpoints reads it here)

SOURCES: dict[str, Any] = {"dots1": oracle_families.CONFIGS["dots1"],
                           "ernie4_5_moe": oracle_families.CONFIGS["ernie4_5_moe"], "mistral4": oracle_mistral4.CONFIG}
OVERRIDES: dict[str, dict[str, Any]] = {
    "mistral4": {"rope_parameters": {**oracle_mistral4.ROPE, "original_max_position_embeddings": 64}},
    "ernie4_5_moe": {"moe_layer_interval": 1, "moe_layer_end_index": -1, "num_key_value_heads": 4},
    "dots1": {"sliding_window": None, "layer_types": ["full_attention"] * 3, "num_key_value_heads": 4,
              "attention_bias": False},
}


def build_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> Path:
    def config() -> Any:
        cfg = SOURCES[arch]()  # rebuilt, so that what the config derives follows the overrides
        return type(cfg).from_dict({**cfg.to_dict(), **OVERRIDES[arch]})

    if arch == "mistral4":  # no AutoModelForCausalLM class: oracle_mistral4's builder on the new config
        def build() -> Any:
            with oracle._quiet():
                oracle.torch.manual_seed(seed)
                model = oracle_mistral4.Mistral4ForCausalLM._from_config(
                    config(), attn_implementation="eager", dtype=oracle.torch.float32, experts_implementation="eager")
            model.eval()
            oracle.reinit_hot(model, seed)
            return model

        return oracle.save_in_layout(build, "per_expert", out_dir)
    return oracle.save_in_layout(lambda: oracle.build_from_config(config, seed), "per_expert", out_dir)


def reference_run(folder: Path, prompt: list[int], n_decode: int = 8) -> Any:
    mistral4 = '"mistral4"' in (Path(folder) / "config.json").read_text()
    return (oracle_mistral4.reference_run if mistral4 else oracle.reference_run)(folder, prompt, n_decode)
