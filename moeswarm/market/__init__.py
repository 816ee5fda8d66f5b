"""The scarcity market: measured demand, announced supply, expert assignment, prices.

Pure cores (no I/O): ``DemandCounter`` and the signed ``DemandReport`` merge (demand),
``supply_from_holders`` (supply), ``compute_prices`` / ``PriceTable`` (scarcity and price),
``target_replicas`` (replicas in proportion to demand x cost), ``assign`` (which experts a
joining volunteer holds), ``rebalance`` / ``plan_move`` (moves
with hysteresis that never uncover an expert). The thin shells: ``fetch_state`` reads a live
DHT, ``state_from_json`` a state file, and ``moeswarm market`` (``moeswarm.market_cli``, beside the other commands: it joins the swarm through ``moeswarm.daemon``) shows
coverage and prices.
"""

from ._assign import (
    OFF_TIER,
    AssignConfig,
    Assignment,
    CellValues,
    DeviceClass,
    Volunteer,
    assign,
    capacity_cells,
    cell_values,
    choose_rects,
    effective_class,
    fast_held,
    folded,
    hot_mask,
    replica_targets,
    score_rects,
    within_rate,
)
from ._demand import Demand, DemandConfig, DemandCounter
from ._dht import (
    DHT,
    demand_key,
    demand_provider_key,
    fetch_announcements,
    fetch_reports,
    fetch_state,
    publish_demand,
    validate_demand_record,
)
from ._grid import (
    Block,
    ModelShape,
    Rect,
    Score,
    best_rect,
    best_signed_rect,
    better,
    pareto_shapes,
)
from ._layers import layer_rates, whole_layers
from ._near import NEAR_RTT_S, near_supply, round_trip_regions
from ._price import (
    PRICE_KIND,
    PriceConfig,
    PriceTable,
    compute_prices,
    price_table_from_json,
    price_table_to_json,
    scarcity,
    smooth,
    target_multipliers,
)
from ._rebalance import (
    MovePlan,
    PlanStep,
    RebalanceConfig,
    check_plan,
    drop_is_safe,
    plan_move,
    rebalance,
)
from ._reports import (
    REPORT_KIND,
    DemandReport,
    MergeConfig,
    MergeResult,
    decode_report,
    encode_report,
    merge_reports,
    report_from_counter,
    sign_report,
    verify_report,
)
from ._state import (
    HolderRecord,
    MarketState,
    shape_from_json,
    state_from_json,
    summarize,
)
from ._supply import HolderLike, Supply, supply_from_holders
from ._target import target_replicas
from ._volunteer import market_assignment, model_shape

__all__ = [
    "market_assignment",
    "model_shape",
    # grid
    "ModelShape", "Block", "Rect", "Score", "best_rect", "best_signed_rect", "better", "pareto_shapes",
    # demand
    "Demand", "DemandConfig", "DemandCounter", "DemandReport", "REPORT_KIND", "sign_report", "verify_report",
    "encode_report", "decode_report", "report_from_counter", "MergeConfig", "MergeResult", "merge_reports",
    # supply
    "Supply", "HolderLike", "supply_from_holders",
    # price
    "PriceConfig", "PriceTable", "PRICE_KIND", "scarcity", "target_multipliers", "smooth", "compute_prices",
    "price_table_to_json", "price_table_from_json",
    # assignment
    "Volunteer", "DeviceClass", "AssignConfig", "Assignment", "assign", "capacity_cells", "cell_values",
    "choose_rects", "score_rects", "effective_class", "hot_mask", "CellValues", "OFF_TIER", "folded", "fast_held",
    "replica_targets", "within_rate", "target_replicas",
    # regions and whole layers
    "NEAR_RTT_S", "near_supply", "round_trip_regions", "layer_rates", "whole_layers",
    # rebalancing
    "RebalanceConfig", "PlanStep", "MovePlan", "rebalance", "plan_move", "check_plan", "drop_is_safe",
    # state and I/O shells
    "MarketState", "HolderRecord", "state_from_json", "shape_from_json", "summarize",
    "DHT", "fetch_state", "fetch_announcements", "fetch_reports", "publish_demand", "demand_key",
    "demand_provider_key", "validate_demand_record",
]
