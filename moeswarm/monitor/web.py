"""The monitor's HTTP side: the page (``/`` and ``/static/*``, served from this package: no CDN),
the snapshot as JSON (``/api/v1/swarm``), and swarm-wide Prometheus figures (``/metrics``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ..net.http_guard import HttpLimits, guarded_runner, host_check, start_runner

STATIC = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}


class _SwarmCollector:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.snapshot()
        uncovered = GaugeMetricFamily("moeswarm_swarm_experts_uncovered", "Experts with no live replica",
                                      labels=["model"])
        minimum = GaugeMetricFamily("moeswarm_swarm_min_replicas", "Fewest live replicas of an expert in the layer",
                                    labels=["model", "layer"])
        replicas = GaugeMetricFamily("moeswarm_swarm_replicas_live", "Live (layer, expert) replicas", labels=["model"])
        for m in snap["models"]:
            uncovered.add_metric([m["model_id"]], m["uncovered_experts"])
            replicas.add_metric([m["model_id"]], m["replicas_live"])
            for layer, low in zip(m["moe_layers"], m["min_replicas_per_layer"]):
                minimum.add_metric([m["model_id"], str(layer)], low)
        states = GaugeMetricFamily("moeswarm_swarm_nodes", "Holders by state", labels=["state"])
        for state in ("online", "unreachable", "joining"):
            states.add_metric([state], sum(n["state"] == state for n in snap["nodes"]))
        relayed = GaugeMetricFamily("moeswarm_swarm_relay_nodes", "Holders reached through a relay")
        relayed.add_metric([], sum(n["via"] == "relay" for n in snap["nodes"]))
        yield from (uncovered, minimum, replicas, states, relayed)


def app(snapshot: Callable[[], dict[str, Any]], bind_host: str = "127.0.0.1",
        allowed_hosts: tuple[str, ...] = ()) -> web.Application:
    """The map's routes; a request whose Host is not ``bind_host`` (or one of ``allowed_hosts``, a
    proxy's name) gets 421, so a DNS-rebinding page cannot read the snapshot."""
    registry = CollectorRegistry()
    registry.register(_SwarmCollector(snapshot))  # type: ignore[arg-type]
    static = resources.files(__package__) / "static"

    async def page(request: web.Request) -> web.Response:
        name = request.match_info.get("name", "index.html")
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.Response(body=(static / name).read_bytes(), content_type=STATIC[name],
                            headers={"Cache-Control": "no-cache"})

    async def api(request: web.Request) -> web.Response:
        return web.json_response(snapshot(), headers={"Cache-Control": "no-store"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain", charset="utf-8")

    application = web.Application(middlewares=[host_check(bind_host, allowed_hosts)])
    application.router.add_get("/", page)
    application.router.add_get("/static/{name}", page)
    application.router.add_get("/api/v1/swarm", api)
    application.router.add_get("/metrics", metrics)
    return application


async def serve(snapshot: Callable[[], dict[str, Any]], host: str, port: int, limits: HttpLimits = HttpLimits(),
                allowed_hosts: tuple[str, ...] = ()) -> tuple[web.AppRunner, str]:
    runner = guarded_runner(app(snapshot, host, allowed_hosts), limits, access_log=None)
    bound = await start_runner(runner, host, port, "serve the swarm map", limits)
    return runner, f"http://{host}:{bound}"
