"""One of moeswarm's aiohttp services, started by its own serving code in this process, for the
HTTP attack tests (issue 32, attacks 6 and 8):

    python http_victims.py ledger|api|monitor [--header-timeout S] [--body-timeout S] [--idle-timeout S] [--max-conns-per-ip N]

- ``ledger``: ``LedgerService`` over a fresh SQLite ledger (what ``moeswarm-ledger serve`` runs);
- ``api``: the backbone's OpenAI API (``serve_http``) over a stand-in generation service that
  answers ``GET /v1/models`` (the slow clients never get as far as a generation);
- ``monitor``: the swarm map (``monitor.web.serve``) over an empty snapshot.

Prints ``READY {"url": ...}`` and serves until stdin closes. On a commit without ``HttpLimits``
(52de96c) the limits cannot be given and the service starts with what that commit had.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def _limits(args: argparse.Namespace) -> Any:
    try:
        from moeswarm.net.http_guard import HttpLimits
    except ImportError:  # the base commit: no bounds to give
        return None
    return HttpLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                      idle_timeout_s=args.idle_timeout, max_conns_per_ip=args.max_conns_per_ip)


class _StandIn:
    """What the API's ``GET /v1/models`` reads of a ``GenerationService``."""

    model_id = "victim/model"
    context_length = 512

    class engine:  # noqa: N801 (the service's engine: its speculative setting, for the model card)
        class config:  # noqa: N801
            speculative = 0


async def ledger(args: argparse.Namespace, limits: Any) -> tuple[str, Any]:
    from moeswarm.ledger import Ledger, StoreConfig
    from moeswarm.ledger._service import LedgerService, ServiceConfig
    from moeswarm.protocol import Identity

    folder = tempfile.mkdtemp(prefix="victim-ledger-")
    store = Ledger(StoreConfig(str(Path(folder) / "ledger.db"), create=True), Identity.generate())
    config = ServiceConfig(limits=limits) if limits is not None else ServiceConfig()
    service = LedgerService(store, config)
    await service.start()

    async def stop() -> None:
        await service.aclose()
        store.close()

    return service.url, stop


async def api(args: argparse.Namespace, limits: Any) -> tuple[str, Any]:
    from moeswarm.node.http_api import ApiConfig, serve_http

    config = ApiConfig(limits=limits) if limits is not None else ApiConfig()
    runner, port = await serve_http(_StandIn(), "127.0.0.1", 0, config)  # type: ignore[arg-type]
    return f"http://127.0.0.1:{port}", runner.cleanup


async def monitor(args: argparse.Namespace, limits: Any) -> tuple[str, Any]:
    from moeswarm.monitor.web import serve

    def snapshot() -> dict[str, Any]:
        return {"models": [], "nodes": [], "secret": "what a DNS-rebinding page must not read"}

    runner, url = await (serve(snapshot, "127.0.0.1", 0, limits) if limits is not None
                         else serve(snapshot, "127.0.0.1", 0))
    return url, runner.cleanup


async def main(args: argparse.Namespace) -> None:
    limits = _limits(args)
    url, stop = await {"ledger": ledger, "api": api, "monitor": monitor}[args.service](args, limits)
    print("READY " + json.dumps({"url": url, "limits": limits is not None}), flush=True)
    try:
        await asyncio.to_thread(sys.stdin.readline)
    finally:
        await stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("service", choices=["ledger", "api", "monitor"])
    parser.add_argument("--header-timeout", type=float, default=20.0)
    parser.add_argument("--body-timeout", type=float, default=20.0)
    parser.add_argument("--idle-timeout", type=float, default=75.0)
    parser.add_argument("--max-conns-per-ip", type=int, default=64)
    asyncio.run(main(parser.parse_args()))
