"""``moeswarm market``: coverage and prices of a model's swarm, as a table or JSON.

The input is a state file (schema: ``moeswarm.market._state``). A live view reads the same
``MarketState`` from the DHT with ``moeswarm.market.fetch_state`` and renders it with
``show_state``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ._cli_util import friendly_errors
from .errors import ConfigError
from .market._assign import AssignConfig, Assignment, Volunteer, assign
from .market._price import PriceConfig
from .market._state import MarketState, state_from_json, summarize


def load_state(path: str) -> MarketState:
    """Read a state file; ``ConfigError`` if it is missing or not valid JSON."""
    try:
        obj = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON: {exc}") from None
    return state_from_json(obj)


def show_state(state: MarketState, *, as_json: bool = False, suggestion: Assignment | None = None,
               price_config: PriceConfig = PriceConfig()) -> None:
    """Print the market view of ``state``: a rich table, or JSON with ``as_json``."""
    summary = summarize(state, state.prices(price_config))
    if suggestion is not None:
        summary["suggestion"] = {"blocks": [{"layers": list(b.layers), "experts": list(b.experts)}
                                            for b in suggestion.blocks],
                                 "bytes": suggestion.bytes, "node_args": suggestion.node_args()}
    if as_json:
        click.echo(json.dumps(summary))
        return
    _render(summary)


def _render(s: dict[str, Any]) -> None:
    from rich.table import Table

    from ._cli_util import console as rich_console

    console = rich_console()
    console.print(f"[bold]{s['model_id']}[/]  epoch {s['epoch']}  coverage [bold]{100 * s['coverage']:.1f}%[/] "
                  f"of {s['experts']} experts  holders {s['holders']}  held {_size(s['held_bytes'])} "
                  f"= {s['capacity_ratio']:.2f}x the model  demand reporters {s['demand_reporters']}")
    table = Table(show_lines=False)
    for col in ("layer", "covered", "replicas min/med/max", "demand", "hottest (share)", "price min/med/max"):
        table.add_column(col, justify="right")
    for row in s["layers"]:
        covered = f"{row['covered']}/{row['experts']}"
        if row["covered"] < row["experts"]:
            covered = f"[red]{covered}[/]"
        table.add_row(str(row["layer"]), covered,
                      f"{row['replicas_min']}/{row['replicas_median']:g}/{row['replicas_max']}",
                      f"{100 * row['demand_share']:.1f}%",
                      f"{row['hottest_expert']} ({100 * row['hottest_share']:.1f}%)",
                      f"{row['price_min']:.2f}/{row['price_median']:.2f}/{row['price_max']:.2f}")
    console.print(table)
    if s["uncovered"]:
        shown = ", ".join(f"L{layer}/e{e}" for layer, e in s["uncovered"][:20])
        more = f" ... (+{len(s['uncovered']) - 20})" if len(s["uncovered"]) > 20 else ""
        console.print(f"[red]uncovered:[/] {shown}{more}")
    if "suggestion" in s:
        console.print(f"suggested for the volunteer: moeswarm node {' '.join(s['suggestion']['node_args'])} "
                      f"({_size(s['suggestion']['bytes'])})")


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def live_state(model_dir: str, bootstrap: tuple[str, ...], model_id: str | None = None,
               ledger_url: str | None = None) -> MarketState:
    """The market read live from the swarm's DHT (joins as a DHT client for the duration)."""
    import asyncio

    from .daemon import SwarmConfig, p2p_node  # joins the swarm as a DHT client
    from .market._dht import fetch_state
    from .market._volunteer import model_shape
    from .model import load_config
    from .model.model_id import model_id_for
    from .protocol import Identity

    cfg = load_config(model_dir)
    shape = model_shape(model_dir, cfg, model_id or model_id_for(model_dir, cfg))

    async def read() -> MarketState:
        async with p2p_node(Identity.generate(), SwarmConfig(model_dir, bootstrap=bootstrap, client_mode=True)) as dht:
            return await fetch_state(dht, shape, ledger_url=ledger_url)

    return asyncio.run(read())


@click.command()
@click.option("--state", "state_file", default=None, type=click.Path(dir_okay=False),
              help="JSON state file: the model's shape, holders and demand (schema: moeswarm.market._state).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (totals, per-layer rows, uncovered experts, "
                                                      "the full price table) instead of a table.")
@click.option("--suggest", "suggest_memory", default=None, metavar="SIZE",
              help="Also show what a volunteer with this much memory for experts (e.g. 8GB) should hold.")
@click.option("--throughput", default=1000.0, show_default=True, type=click.FloatRange(0),
              help="With --suggest: its (expert, token) pairs per second.")
@click.option("--device-class", default="hub", show_default=True, type=click.Choice(["hub", "edge"]),
              help="With --suggest: hub (fat link, low RTT) or edge (phone, NAT'd box).")
@friendly_errors
@click.option("--bootstrap", multiple=True, metavar="MULTIADDR",
              help="Read the market live from the swarm reached through this peer (with --model).")
@click.option("--model", "model_dir", default=None, type=click.Path(),
              help="With --bootstrap: the model folder (its shape and id).")
@click.option("--ledger", "ledger_url", default=None, metavar="URL",
              help="With --bootstrap: weigh demand reports by the calls each reporter paid this ledger for "
                   "(reporters without standing count for nothing). Without it every signed report counts.")
def market(state_file: str | None, bootstrap: tuple[str, ...], model_dir: str | None, as_json: bool,
           suggest_memory: str | None, throughput: float, device_class: str, ledger_url: str | None) -> None:
    """Show which experts the swarm covers and what each costs this epoch.

    \b
    Examples:
      moeswarm market --model ./mixtral --bootstrap /ip4/.../p2p/12D3KooW...   # live, from the DHT
      moeswarm market --state swarm.json --suggest 8GB --device-class hub       # from a state file
    """
    if (state_file is None) == (not bootstrap):
        raise ConfigError("give either --state FILE or --bootstrap ADDR (with --model DIR)")
    if bootstrap and model_dir is None:
        raise ConfigError("--bootstrap needs --model DIR (the model's shape and id)")
    state = (load_state(state_file) if state_file is not None
             else live_state(model_dir, bootstrap, ledger_url=ledger_url))  # type: ignore[arg-type]
    suggestion = None
    if suggest_memory is not None:
        from .model.memory import parse_size  # one reading of sizes for every command

        volunteer = Volunteer(parse_size(suggest_memory), throughput,
                              "edge" if device_class == "edge" else "hub")
        suggestion = assign(state.shape, state.supply, state.demand, volunteer, AssignConfig())
    show_state(state, as_json=as_json, suggestion=suggestion)
