"""``moeswarm monitor``: the swarm map's command line."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import click

from .._cli_util import friendly_errors, http_limit_options, http_limits


@click.command()
@click.option("--bootstrap", multiple=True, required=True, metavar="MULTIADDR",
              help="A swarm peer to join the DHT through, as a client (repeatable).")
@click.option("--model", "models", multiple=True, required=True, type=click.Path(exists=True),
              help="A model to watch: the checkpoint folder (or its config.json, or GGUF file) the swarm uses; "
                   "only its config is read (repeatable).")
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
    demand reports of each --model, pings every holder it can reach, and serves the map. Example:

    \b
        moeswarm monitor --bootstrap /ip4/203.0.113.5/tcp/4001/p2p/12D3KooW... --model ./mixtral

    Prints `READY {json}` (http, peer_id, models) on stdout once serving.
    """
    from ..daemon import check_listen, run_daemon
    from ..node.cli import host_port

    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), format="%(asctime)s %(name)s %(message)s")
    if relay_ca is not None:
        from ..relay import set_relay_ca

        set_relay_ca(relay_ca)
    host, port = host_port(http)
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
    swarm = SwarmConfig(models[0], bootstrap=bootstrap, client_mode=True)
    say(joining(swarm))
    async with p2p_node(identity, swarm) as p2p:
        names = {model_id: model_name(path) for (model_id, _), path in zip(watched, models, strict=True)}
        watch = SwarmWatch(p2p, watched, WatchConfig(interval_s=interval, ledger_url=ledger_url), names)
        await watch.start()
        try:
            from ..net.http_guard import HttpLimits

            runner, url = await serve(watch.snapshot, host, port, http_limits or HttpLimits(), allowed_hosts)
            try:
                (on_ready or ready)({"http": url, "peer_id": identity.peer_id_str,
                                     "models": [model_id for model_id, _ in watched]})
                say(f"serving the swarm map at {url}/ (Ctrl-C to stop)")
                await stop.wait()
            finally:
                await runner.cleanup()
        finally:
            await watch.aclose()
