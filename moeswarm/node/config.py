"""What a volunteer's expert node and a backbone are configured with (the CLI's flags, as data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..daemon import SwarmConfig
from ..errors import ConfigError
from ..net.http_guard import HttpLimits
from .dispatch import DispatchConfig
from .scheduler import EngineConfig
from .verify import VerifyConfig

if TYPE_CHECKING:
    from ..market import RebalanceConfig


@dataclass(frozen=True)
class NodeConfig:
    swarm: SwarmConfig
    layers: str | None = None  # inclusive range, default all
    experts: str | None = None  # inclusive range, default all
    data_port: int = 0
    announce_port: int | None = None  # data-plane port others dial, if not data_port (NAT, proxy)
    announce_interval_s: float = 240.0  # protocol_spec: refresh every 4 minutes
    record_ttl_s: float = 600.0  # ... with records that expire 10 minutes ahead
    memory_budget: int | None = None  # bytes of resident memory to stay under (None: no limit)
    capacity_bytes: int | None = None  # --experts auto: memory offered for expert weights (default: budget or half of free RAM)
    throughput: float = 10_000.0  # --experts auto: (expert, token) pairs per second this machine can compute
    device_class: str = "hub"  # --experts auto: "hub" (fat link) or "edge" (phone, NAT'd box)
    max_blocks: int = 64  # --experts auto: blocks (layer range x expert range) this process may hold and announce
    rebalance_interval_s: float = 600.0  # --experts auto: re-evaluate the block about this often, seconds (0: never)
    rebalance_grace_s: float = 30.0  # after a move, serve the old block this long too (calls in flight, stale tables)
    rebalance: RebalanceConfig | None = None  # --experts auto: hysteresis and cooldown of moves (None: the market's)
    status: tuple[str, int] | None = ("127.0.0.1", 0)  # serve /status and /metrics here (None: not at all)
    probe_interval_s: float = 30.0  # re-measure the links to peers this often (0: never)
    serve_weights: bool = True  # answer weight fetches (False: they get UNKNOWN_EXPERT, calls go on)
    require_funded: str | None = None  # a ledger URL: serve only clients it says hold credit (None: serve anyone)
    market_ledger: str | None = None  # --experts auto: weigh demand reports by this ledger's standing (None: all)
    max_connections: int = 1024  # data plane: connections held at once
    max_conns_per_ip: int = 32  # ... from one IPv4 address or IPv6 /64
    max_conns_per_peer: int = 4  # ... by one authenticated peer
    frame_timeout_s: float = 10.0  # ... a frame's body must arrive within this plus 1 s per MB once its header did
    idle_timeout_s: float = 300.0  # ... a connection silent this long with nothing in flight is closed
    protocol_versions: tuple[int, ...] = (1, 2)  # ... versions offered ((1,): every answer carries its signed receipt)

    def __post_init__(self) -> None:
        from ..protocol import MAX_BLOCKS

        if not 1 <= self.max_blocks <= MAX_BLOCKS:
            raise ConfigError(f"--max-blocks is 1..{MAX_BLOCKS} (what one announcement may claim), not {self.max_blocks}")


@dataclass(frozen=True)
class BackboneConfig:
    swarm: SwarmConfig
    http: tuple[str, int] | None = None  # serve the OpenAI API here
    local_fallback: bool = False  # compute unreachable experts from the local checkpoint
    coverage_timeout_s: float = 60.0  # wait this long for every expert to be announced
    discovery_interval_s: float = 10.0
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)  # check holders' outputs (fraction 0: off)
    demand_interval_s: float = 120.0  # publish the routers' decayed expert counts (signed) this often
    ledger_url: str | None = None  # submit countersigned receipts to this ledger service
    ledger_queue_dir: str | None = None  # receipts spooled here until the ledger acknowledges them
    audit_fraction: float = 0.0  # share of expert calls the ledger re-executes (needs ledger_url), 0..1
    audit_drain_s: float = 30.0  # on shutdown, wait at most this long for the audits still queued
    tiers: str = "remote"  # "remote": every routed expert is called in the swarm; "auto": the tier planner
    # decides; "fetch": every expert is fetched from a holder on a miss and computed here
    fetch_cache_bytes: int = 1 << 30  # --tiers auto: memory for expert weights fetched from holders
    probe_interval_s: float = 30.0  # re-measure the links to holders this often (0: never)
    replan_s: float = 10.0  # recompute the tier plan this often
    engine: EngineConfig = field(default_factory=EngineConfig)  # continuous batching, cache pool, speculative
    draft_model: str | None = None  # with engine.speculative > 0: drafts from this local checkpoint, not prompt lookup
    draft: str = "lookup"  # "lookup" (prompt lookup, or draft_model) or "mtp": the checkpoint's own MTP layer
    api_key: str | None = None  # the HTTP API requires "Authorization: Bearer <api_key>" (needed off loopback)
    max_tokens_cap: int = 4096  # the HTTP API refuses requests for more new tokens than this
    http_limits: HttpLimits = field(default_factory=HttpLimits)  # the HTTP API's header/idle timeouts, conns per address
    gateway: bool = False  # serve other people's requests: announce the API in the swarm (moeswarm.node.gateway)
    gateway_price: int = 0  # with gateway: credits per generated token a person pays (signed in their authorization)
    gateway_url: str | None = None  # with gateway: the API URL announced (default: http://<announce host or host>:<port>)

    def __post_init__(self) -> None:
        if not 0.0 <= self.audit_fraction <= 1.0:
            raise ConfigError(f"the audit fraction must be within 0..1, not {self.audit_fraction}")
        if self.audit_fraction > 0 and self.ledger_url is None:
            raise ConfigError("audits are judged by the ledger: --audit-fraction needs --ledger")
        if self.draft_model is not None and not self.engine.speculative:
            raise ConfigError("--draft-model needs --speculative K (draft tokens per step)")
        if self.gateway and self.http is None:
            raise ConfigError("a gateway serves the HTTP API: --gateway needs --http")
        if self.gateway_price and not (self.gateway and self.ledger_url):
            raise ConfigError("a priced gateway charges people through a ledger: --gateway-price needs --gateway "
                              "and --ledger")
        if self.draft not in ("lookup", "mtp"):
            raise ConfigError(f"--draft is 'lookup' or 'mtp', not {self.draft!r}")
        if self.draft == "mtp" and (self.draft_model is not None or not self.engine.speculative):
            raise ConfigError("--draft mtp drafts with the checkpoint's own MTP layer: give --speculative K, "
                              "not --draft-model")
        if self.tiers not in ("remote", "auto", "fetch"):
            raise ConfigError(f"--tiers is 'remote', 'auto' or 'fetch', not {self.tiers!r}")
