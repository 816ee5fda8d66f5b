"""``moeswarm bridge --experts auto``: ask the swarm's market which experts to serve, export them.

The bridge joins the DHT for a moment as a client (it only dials out, so this works behind
NAT), reads the market's supply and demand, and lets ``moeswarm.market.assign`` pick one block
for an edge device of the given capacity (edge devices take the long tail). The block is
exported with ``export_onnx`` into a cache folder, or an earlier export with the same manifest
is reused, and the DHT client is closed: from then on the bridge serves the folder exactly as
with ``--shards``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from ..daemon import SwarmConfig, load_identity, p2p_node
from ..errors import ConfigError
from ..market import Block, Volunteer, market_assignment, model_shape
from ..model import ModelConfig, load_config
from ..model.model_id import model_id_for
from ._graph import DTYPES
from ._manifest import Manifest
from .export import export_onnx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoConfig:
    model_dir: str  # the checkpoint every peer of the swarm uses (config.json + *.safetensors)
    bootstrap: tuple[str, ...]  # multiaddrs with /p2p/<peer id> to read the market through
    capacity_bytes: int | None = None  # memory for the exported expert weights (default: half the free RAM)
    throughput: float = 1_000.0  # (expert, token) pairs per second this device computes, an estimate
    dtype: str = "fp32"  # export dtype: "fp32" matches the engine, "fp16" halves the bytes
    cache_dir: str | None = None  # exports live here (default: ~/.cache/moeswarm/shards)
    model_id: str | None = None  # default: derived from config.json, as nodes do


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moeswarm" / "shards"


def block_folder(cache: Path, model_id: str, block: Block, dtype: str) -> Path:
    (l0, l1), (e0, e1) = block.layers, block.experts
    return cache / model_id / f"layers{l0}-{l1}_experts{e0}-{e1}_{dtype}"


def onnx_expert_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of one exported expert's three matrices (the small biases some models have aside)."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * np.dtype(DTYPES[dtype][0]).itemsize


def reusable(folder: Path, model_id: str, block: Block, dtype: str) -> bool:
    """Does ``folder`` hold an intact export of exactly ``block``?"""
    try:
        m = Manifest.read(folder)
        if (m.model_id, m.layers, m.experts, m.dtype) != (model_id, block.layers, block.experts, dtype):
            return False
        m.verify(folder)
    except ConfigError:
        return False
    return True


async def market_block(config: AutoConfig, cfg: ModelConfig, model_id: str) -> Block:
    """The block the market assigns this device, read through a short-lived DHT client."""
    if not config.bootstrap:
        raise ConfigError("--experts auto reads the market through the swarm: give --bootstrap MULTIADDR")
    if config.dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {config.dtype!r}")
    shape = model_shape(config.model_dir, cfg, model_id)
    capacity = config.capacity_bytes or int(psutil.virtual_memory().available // 2)
    # the market counts experts at the checkpoint's size; this device holds them at the export's
    memory = capacity * shape.expert_bytes // onnx_expert_bytes(cfg, config.dtype)
    volunteer = Volunteer(memory_bytes=memory, throughput=config.throughput, device_class="edge")
    reader = load_identity(None)  # a throwaway key: reading the market says nothing about the device
    async with p2p_node(reader, SwarmConfig(config.model_dir, bootstrap=config.bootstrap, client_mode=True)) as dht:
        return (await market_assignment(dht, shape, volunteer))[0]  # a device serves one block


async def market_shards(config: AutoConfig) -> tuple[Path, Block]:
    """Ask the market for a block and return a shard folder holding exactly it (exported if needed)."""
    cfg = load_config(config.model_dir)
    model_id = config.model_id or model_id_for(config.model_dir, cfg)
    block = await market_block(config, cfg, model_id)
    cache = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    folder = block_folder(cache, model_id, block, config.dtype)
    if await asyncio.to_thread(reusable, folder, model_id, block, config.dtype):
        log.info("market assigned %s; reusing %s", block, folder)
    else:
        log.info("market assigned %s; exporting it to %s", block, folder)
        await asyncio.to_thread(export_onnx, config.model_dir, folder, layers=block.layers, experts=block.experts,
                                dtype=config.dtype, model_id=model_id)
    return folder, block
