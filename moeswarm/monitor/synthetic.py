"""A synthetic swarm at real scale, for the monitor's tests and benchmark: ``n`` signed announcements
over a model of the MiniMax M3 shape (57 MoE layers x 128 experts, top-4), fed to a ``SwarmWatch``
through the record validation every DHT record passes, with no DHT behind it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..protocol import Identity, announcement_key, decode, encode, sign_announcement, validate_record
from .watch import SwarmWatch, WatchConfig, model_from

M3_SHAPE = {"num_hidden_layers": 57, "num_local_experts": 128, "num_experts_per_tok": 4}


class NoDHT:
    """A DHT with nothing in it (the announcements are fed to the table directly)."""

    async def find_providers(self, key: str) -> list[str]:
        return []

    async def get(self, key: str) -> bytes | None:
        return None


def write_m3_shaped_config(folder: Path) -> Path:
    """A config.json with MiniMax M3's expert grid (tiny hidden sizes: the monitor reads only the shape)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 1e6, **M3_SHAPE}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def synthetic_watch(folder: Path, holders: int = 500, seed: int = 0) -> SwarmWatch:
    """A watch of ``folder``'s model holding ``holders`` validated announcements of random blocks."""
    model_id, cfg = model_from(str(folder))
    watch = SwarmWatch(NoDHT(), [(model_id, cfg)], WatchConfig(interval_s=3600, ping_timeout_s=0.5))
    table = watch.models[model_id].table
    rng = np.random.default_rng(seed)
    moe = [L for L in range(cfg.num_layers) if cfg.moe_layers[L]]
    expires = int(time.time() * 1000) + 3_600_000
    for i in range(holders):
        first = int(rng.integers(0, len(moe)))
        last = min(len(moe) - 1, first + int(rng.integers(0, 12)))
        e0 = int(rng.integers(0, cfg.num_experts))
        e1 = min(cfg.num_experts - 1, e0 + int(rng.integers(0, 32)))
        identity = Identity.generate()
        ann = sign_announcement(identity, model_id=model_id, layers=(moe[first], moe[last]), experts=(e0, e1),
                                endpoints=("tcp+tls://127.0.0.1:1",), capacity_bytes=1 << 30,
                                throughput=int(rng.integers(100, 10_000)), load_permille=int(rng.integers(0, 1000)),
                                software="moeswarm/0.1.0", seq=1, expires_at_ms=expires)
        value = encode(ann)
        validate_record(announcement_key(model_id, moe[first], identity.peer_id), value)  # as the DHT does
        table.update(decode(value))  # type: ignore[arg-type]
    return watch


def snapshot_size(snapshot: dict[str, Any]) -> int:
    return len(json.dumps(snapshot))
