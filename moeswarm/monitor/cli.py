"""``moeswarm monitor``: the swarm map's command line."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import click

from .._cli_util import friendly_errors, host_port, http_limit_options, http_limits


@click.command()
@click.option("--bootstrap", multiple=True, required=True, metavar="MULTIADDR",
              help="A swarm peer to join the DHT through, as a client (repeatable).")
@click.option("--model", "models", multiple=True, type=click.Path(exists=True),
              help="Watch only this model: the checkpoint folder (or its config.json, or GGUF file) the swarm uses; "
                   "only its config is read (repeatable). Default: every model in the swarm's catalogue.")
@click.option("--ledger", "ledger_url", default=None, metavar="URL",
              help="A ledger service (moeswarm-ledger serve): show its top contributors by settled credit.")
@click.option("--http", "http", default="127.0.0.1:8700", show_default=True, metavar="HOST:PORT",
              help="Serve the map (/), its JSON (/api/v1/swarm) and /metrics here (port 0: any free).")
@click.option("--interval", default=5.0, show_default=True, type=click.FloatRange(min=0.2), metavar="SECONDS",
              help="Re-read the DHT and ping every holder this often.")
@click.option("--relay-ca", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Trust this CA for relays of devices behind NAT (default: the system trust store).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="A Host name the map answers to besides its --http address (a reverse proxy's; repeatable).")
@click.option("-v", "--verbose", count=True, help="More logging on stderr.")
@http_limit_options
@friendly_errors
def monitor(bootstrap: tuple[str, ...], models: tuple[str, ...], ledger_url: str | None, http: str, interval: float,
            relay_ca: str | None, allowed_hosts: tuple[str, ...], verbose: int, **limits: Any) -> None:
    """A live web page of a swarm: coverage of every expert, nodes, links, demand and contributions.

    Joins the DHT as a client (it works for private swarms too), crawls the announcements and
    demand reports of each model, pings every holder it can reach, and serves the map. Without
    --model it watches every model the swarm's catalogue names (each config fetched from a holder
    and checked against the published digest; new models appear as they are announced). Example:

    \b
        moeswarm monitor --bootstrap /ip4/203.0.113.5/tcp/4001/p2p/12D3KooW...
        moeswarm monitor --bootstrap /ip4/203.0.113.5/tcp/4001/p2p/12D3KooW... --model ./mixtral

    Prints `READY {json}` (http, peer_id, models) on stdout once serving.
    """
    from ..daemon import check_listen, run_daemon

    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), format="%(asctime)s %(name)s %(message)s")
    if relay_ca is not None:
        from ..relay import set_relay_ca

        set_relay_ca(relay_ca)
    host, port = host_port(http, "--http")
    check_listen(host, port, "--http")
    run_daemon(run_monitor(bootstrap, models, host, port, interval, ledger_url, http_limits=http_limits(limits),
                           allowed_hosts=allowed_hosts))


async def run_monitor(bootstrap: tuple[str, ...], models: tuple[str, ...], host: str, port: int, interval: float,
                      ledger_url: str | None, on_ready: Any = None, stop: asyncio.Event | None = None,
                      http_limits: Any = None, allowed_hosts: tuple[str, ...] = ()) -> None:
    from ..daemon import SwarmConfig, joining, p2p_node, ready, say, stop_event
    from ..protocol import Identity
    from .watch import SwarmWatch, WatchConfig, model_from, model_name
    from .web import serve

    watched = [model_from(m) for m in models]
    stop = stop or stop_event()
    identity = Identity.generate()
    swarm = SwarmConfig("", bootstrap=bootstrap, client_mode=True)
    say(joining(swarm))
    async with p2p_node(identity, swarm) as p2p:
        names = {model_id: model_name(path) for (model_id, _), path in zip(watched, models, strict=True)}
        watch = SwarmWatch(p2p, watched, WatchConfig(interval_s=interval, ledger_url=ledger_url), names,
                           catalogue=not models)
        await watch.start()
        try:
            from ..net.http_guard import HttpLimits

            runner, url = await serve(watch.snapshot, host, port, http_limits or HttpLimits(), allowed_hosts)
            try:
                (on_ready or ready)({"http": url, "peer_id": identity.peer_id_str,
                                     "models": list(watch.models)})
                say(f"serving the swarm map at {url}/ (Ctrl-C to stop)")
                await stop.wait()
            finally:
                await runner.cleanup()
        finally:
            await watch.aclose()


@click.command()
@click.option("--bootstrap", multiple=True, required=True, metavar="MULTIADDR",
              help="A swarm peer to join the DHT through, as a client (repeatable).")
@click.option("--model", "models", multiple=True, type=click.Path(exists=True),
              help="List only this model: its checkpoint folder (or config.json, or GGUF file) (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--timeout", default=10.0, show_default=True, type=click.FloatRange(min=0.1), metavar="SECONDS",
              help="Bound on each holder's answer to a config request.")
@click.option("-v", "--verbose", count=True, help="More logging on stderr.")
@friendly_errors
def models(bootstrap: tuple[str, ...], models: tuple[str, ...], as_json: bool, timeout: float, verbose: int) -> None:
    """The models a swarm serves, from its catalogue: id, name, family, shape and holders.

    Joins the DHT as a client, reads the catalogue entries the swarm's nodes publish, fetches each
    model's config from a holder and keeps it only if it matches the digest the entries publish
    (what fails a check is dropped and counted). Example:

    \b
        moeswarm models --bootstrap /ip4/203.0.113.5/tcp/4001/p2p/12D3KooW...
    """
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), format="%(asctime)s %(name)s %(message)s")
    found, rejected = asyncio.run(list_models(bootstrap, models, timeout))
    if as_json:
        click.echo(json.dumps({"models": found, "rejected": rejected}))
        return
    if not found:
        click.echo("no models in this swarm's catalogue")
    else:
        rows = [("MODEL ID", "NAME", "FAMILY", "LAYERS", "EXPERTS", "HOLDERS")]
        rows += [(m["model_id"], m["name"] or "-", m["family"], str(m["num_layers"]), str(m["num_experts"]),
                  str(len(m["holders"]))) for m in found]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    if rejected:
        click.echo("dropped: " + ", ".join(f"{reason} {n}" for reason, n in sorted(rejected.items())))


async def list_models(bootstrap: tuple[str, ...], paths: tuple[str, ...],
                      timeout: float) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """(the catalogue's models whose configs checked out, as JSON objects; what was dropped, by reason)."""
    from ..daemon import SwarmConfig, p2p_node
    from ..errors import CheckpointError
    from ..net.catalogue import read_catalogue, resolve_models
    from ..protocol import Identity
    from .watch import catalogue_fetch, config_from_bytes, model_from

    wanted = [model_from(p)[0] for p in paths] or None
    identity = Identity.generate()
    async with p2p_node(identity, SwarmConfig("", bootstrap=bootstrap, client_mode=True)) as p2p:
        catalogue = await read_catalogue(p2p)
        served = await resolve_models(catalogue, catalogue_fetch(identity, timeout), wanted=wanted)
    out = []
    for m in sorted(served, key=lambda m: m.model_id):
        try:
            cfg = config_from_bytes(m.model_id, m.config)
        except CheckpointError:
            catalogue.reject("config_unsupported")
            continue
        out.append({"model_id": m.model_id, "name": m.name or None, "family": cfg.arch,
                    "config_digest": m.config_digest.hex(), "num_layers": cfg.num_layers,
                    "num_experts": cfg.num_experts, "holders": list(m.holders)})
    return out, catalogue.rejected
