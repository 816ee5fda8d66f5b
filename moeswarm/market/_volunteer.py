"""The shell a volunteer (an expert node or a device bridge) runs for ``--experts auto``: the
model's expert grid as the market sees it, read from the checkpoint, and the blocks the market
assigns, read from the live DHT."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..model import ModelConfig, load_weights
from ._assign import AssignConfig, Volunteer, assign
from ._dht import fetch_state
from ._grid import Block, ModelShape


def model_shape(model_dir: str, cfg: ModelConfig, model_id: str) -> ModelShape:
    """The model's expert grid as the market sees it (bytes per expert read from the checkpoint)."""
    moe = tuple(L for L in range(cfg.num_layers) if cfg.moe_layers[L])
    probe = load_weights(model_dir, config=cfg, keep_expert=lambda L, e: L == moe[0] and e == 0)
    expert_bytes = sum(w.nbytes for layer in probe.experts.values() for w in layer.values())
    return ModelShape(model_id, moe, cfg.num_experts, expert_bytes)


async def market_assignment(p2p: Any, shape: ModelShape, volunteer: Volunteer, *,
                            ledger_url: str | None = None, config: AssignConfig = AssignConfig(),
                            round_trips: Mapping[bytes, float] | None = None) -> tuple[Block, ...]:
    """Ask the market which blocks of experts this volunteer should hold (at most
    ``config.max_blocks``, best first; demand weighed by the standing ``ledger_url`` gives each
    reporter, when given; with ``round_trips``, this volunteer's measured round trips to holders,
    a hub's first fast copies and whole layers count in its region: ``_near.py``)."""
    state = await fetch_state(p2p, shape, ledger_url=ledger_url, round_trips=round_trips)
    assignment = assign(shape, state.supply, state.demand, volunteer, config, near=state.near)
    if not assignment.blocks:
        raise ConfigError(f"{volunteer.memory_bytes / 2**20:.0f} MiB cannot hold a single expert "
                          f"({shape.expert_bytes / 2**20:.1f} MiB)")
    return assignment.blocks
