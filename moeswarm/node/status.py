"""What a running node or backbone reports about itself, and how ``moeswarm node status`` finds it.

Each daemon serves ``GET /status`` (JSON: identity, what it holds and serves, memory figures,
expert-cache and fetch metrics, links to its peers, the tier plan) and ``GET /metrics``
(Prometheus) on a loopback HTTP port, and leaves a run file in ``$MOESWARM_HOME/run`` (default
``~/.moeswarm/run``) naming that URL and its PID, removed when it stops.  ``moeswarm node status``
reads the run files of live processes (or the URLs it is given) and prints their reports.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ..daemon import fetch_reports, run_dir, run_file, running  # noqa: F401 - this module's public names
from ..net.http_guard import HttpLimits, guarded_runner, start_runner

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Snapshot = Callable[[], dict[str, Any]]
STATUS = web.AppKey("status", Callable)


def memory_snapshot() -> dict[str, int]:
    from ..model.memory import MemoryStats

    m = MemoryStats.now()
    return {"vm_size": m.vm_size, "vm_rss": m.vm_rss, "vm_swap": m.vm_swap, "major_faults": m.major_faults,
            "minor_faults": m.minor_faults, "read_bytes": m.disk_read}


def cache_snapshot(stats: Any) -> dict[str, float]:
    """A ``CacheStats`` (the memory budget's expert cache) as JSON."""
    return {"hits": stats.hits, "misses": stats.misses, "hit_rate": round(stats.hit_rate, 4),
            "prefetch_accuracy": round(stats.prefetch_accuracy, 4), "bytes_fetched": stats.bytes_fetched}


def _gauges(snap: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
    """The numeric figures of a status snapshot as Prometheus gauges."""

    def gauge(name: str, doc: str, value: Any, labels: dict[str, str] | None = None) -> GaugeMetricFamily | None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        g = GaugeMetricFamily(f"moeswarm_{name}", doc, labels=list(labels or {}))
        g.add_metric(list((labels or {}).values()), float(value))
        return g

    serving = snap.get("serving", {})
    verification = snap.get("verification", {})
    memory = snap.get("memory", {})
    cache = snap.get("expert_cache", {})
    tiers = snap.get("tiers", {})
    plan = tiers.get("plan", {})
    fetched = tiers.get("fetched", {})
    found = [
        gauge("requests_served", "Expert requests answered", serving.get("requests")),
        gauge("pairs_served", "(token, expert) pairs computed for peers", serving.get("pairs")),
        gauge("load_permille", "Queue load, 0 idle .. 1000 saturated", serving.get("load_permille")),
        gauge("verified_calls", "Holders' expert calls checked", verification.get("checked")),
        gauge("verification_disagreements", "Checked calls whose outputs were wrong", verification.get("disagreements")),
        gauge("excluded_holders", "Holders excluded for wrong outputs",
              len(verification["excluded"]) if "excluded" in verification else None),
        gauge("vm_rss_bytes", "Resident set", memory.get("vm_rss")),
        gauge("vm_size_bytes", "Virtual size", memory.get("vm_size")),
        gauge("vm_swap_bytes", "Swapped out", memory.get("vm_swap")),
        gauge("major_faults", "Major page faults since start", memory.get("major_faults")),
        gauge("disk_read_bytes", "Bytes read from disk since start", memory.get("read_bytes")),
        gauge("expert_cache_hit_rate", "Expert uses already resident", cache.get("hit_rate")),
        gauge("expert_prefetch_accuracy", "Expert picks the next-layer prediction named", cache.get("prefetch_accuracy")),
        gauge("expert_cache_bytes_fetched", "Expert bytes paged in on misses", cache.get("bytes_fetched")),
        gauge("predicted_tokens_per_second", "The tier planner's prediction", plan.get("predicted_tokens_per_s")),
        gauge("fetched_expert_bytes", "Expert weights fetched from holders, in total", fetched.get("bytes_fetched")),
        gauge("fetched_experts_verified", "Fetched experts that matched expert_digests.json", fetched.get("verified")),
        gauge("fetched_experts_rejected", "Fetched experts that differed from expert_digests.json", fetched.get("rejected")),
    ]
    yield from (g for g in found if g is not None)
    for tier, n in plan.get("counts", {}).items():
        g = gauge("planned_experts", "Experts per tier in the current plan", n, {"tier": tier})
        if g is not None:
            yield g
    for peer, link in tiers.get("links", {}).items():
        for key, doc in (("rtt_ms", "Round trip, ms"), ("up_mbit", "Bandwidth to the peer, Mbit/s"),
                         ("down_mbit", "Bandwidth from the peer, Mbit/s")):
            g = gauge(f"link_{key}", doc, link.get(key), {"peer": peer})
            if g is not None:
                yield g


class _Collector:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from _gauges(self.snapshot())


def add_status_routes(app: web.Application, snapshot: Snapshot) -> None:
    """``GET /status`` and ``GET /metrics`` from ``snapshot`` (also on a backbone's API server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot))  # type: ignore[arg-type]

    async def status(request: web.Request) -> web.Response:
        return web.json_response(snapshot(), dumps=lambda o: json.dumps(o, sort_keys=True))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)


async def serve_status(snapshot: Snapshot, host: str = "127.0.0.1", port: int = 0,
                       limits: HttpLimits = HttpLimits()) -> tuple[web.AppRunner, str]:
    """Serve ``/status`` and ``/metrics`` -> (runner, base URL); ``await runner.cleanup()`` stops it."""
    app = web.Application()
    add_status_routes(app, snapshot)
    runner = guarded_runner(app, limits)
    port = await start_runner(runner, host, port, "serve status", limits)
    return runner, f"http://{host}:{port}"


def _mb(n: Any) -> str:
    return f"{n / 2**20:,.0f} MiB" if isinstance(n, (int, float)) else "-"


def render_report(report: dict[str, Any], show_experts: bool = False) -> None:
    from rich.table import Table

    from .._cli_util import console as rich_console

    console = rich_console()
    if "error" in report:
        console.print(f"[red]{report['url']}: {report['error']}[/red]")
        return
    role = report.get("role", "?")
    console.print(f"[bold]{role}[/bold] {report.get('peer_id', '?')}  model {report.get('model_id', '?')}  "
                  f"({report['url']})")
    if role == "node":
        s = report.get("serving", {})
        blocks = report.get("blocks") or [[*report.get("layers", []), *report.get("experts", [])]]
        held = ", ".join(f"layers {b[0]}-{b[1]} x experts {b[2]}-{b[3]}" for b in blocks if len(b) == 4)
        console.print(f"  holds {held or '?'} at "
                      f"{report.get('endpoint')}; served {s.get('requests', 0)} requests, {s.get('pairs', 0)} "
                      f"(token, expert) pairs, load {s.get('load_permille', 0)}/1000")
    if "dispatch" in report:
        d = report["dispatch"]
        console.print(f"  dispatched {d.get('calls', 0)} calls to {len(d.get('served_by', {}))} holders, "
                      f"{d.get('local_pairs', 0)} pairs computed here by plan, {d.get('fallbacks', 0)} fallbacks")
    if "verification" in report:
        v = report["verification"]
        console.print(f"  verification ({v.get('method')}, {v.get('fraction', 0):.0%} of trusted calls, first "
                      f"{v.get('probation_calls')} of each holder): {v.get('checked', 0)} calls checked, "
                      f"{v.get('disagreements', 0)} disagreements, {v.get('verification_calls', 0)} extra calls, "
                      f"evidence {v.get('evidence_published', 0)} published / {v.get('evidence_accepted', 0)} read")
        for peer, why in sorted(v.get("excluded", {}).items()):
            console.print(f"  [red]excluded {peer}: {why}[/red]")
    m = report.get("memory", {})
    console.print(f"  memory: VmSize {_mb(m.get('vm_size'))}, VmRSS {_mb(m.get('vm_rss'))}, VmSwap "
                  f"{_mb(m.get('vm_swap'))}, {m.get('major_faults', 0)} major / {m.get('minor_faults', 0)} minor "
                  f"faults, {_mb(m.get('read_bytes'))} read from disk"
                  + (f", budget {_mb(report['memory_budget'])}" if report.get("memory_budget") else ""))
    if "expert_cache" in report:
        c = report["expert_cache"]
        console.print(f"  expert cache: hit rate {c['hit_rate']:.1%}, prefetch accuracy "
                      f"{c['prefetch_accuracy']:.1%}, {_mb(c['bytes_fetched'])} paged in")
    tiers = report.get("tiers")
    if not tiers:
        return
    lt = tiers.get("local_tier", {})
    console.print(f"  local tier: disk {lt.get('disk_mb_s')} MB/s, expert math {lt.get('compute_gb_s')} GB/s, "
                  f"a decode step without its experts {lt.get('step_without_experts_ms')} ms")
    links = tiers.get("links", {})
    if links or tiers.get("link_errors"):
        table = Table("peer", "rtt ms", "up Mbit/s", "down Mbit/s", "age s", "probes", title="links", title_justify="left")
        for peer, link in sorted(links.items()):
            table.add_row(peer[-12:], f"{link['rtt_ms']:.2f}", f"{link['up_mbit']:.1f}", f"{link['down_mbit']:.1f}",
                          str(link["age_s"]), str(link["probes"]))
        for peer, error in sorted(tiers.get("link_errors", {}).items()):
            table.add_row(peer[-12:], "-", "-", "-", "-", f"[red]{error[:60]}[/red]")
        console.print(table)
    plan = tiers.get("plan")
    if plan is None:
        console.print("  no tier plan yet")
        return
    counts = plan.get("counts", {})
    f = tiers.get("fetched", {})
    console.print(f"  tier plan ({'followed' if tiers.get('acting') else 'shown only'}, {plan.get('age_s')} s old): "
                  f"{counts.get('local', 0)} experts local, {counts.get('remote', 0)} remote, "
                  f"{counts.get('fetch', 0)} fetch; "
                  + (f"predicted {predicted} tokens/s" if (predicted := plan.get("predicted_tokens_per_s")) is not None
                     else "no prediction until holders are measured"))
    if not tiers.get("acting") and not f.get("experts"):  # a node, or a backbone with --tiers remote
        console.print("  fetches no expert weights (the plan is shown, not followed)")
    else:
        console.print(f"  {f.get('experts', 0)} experts fetched ({_mb(f.get('bytes'))}); "
                      + (f"{f.get('verified', 0)} checked against their digests, {f.get('rejected', 0)} refused"
                         if f.get("checked") else "not checked: its model folder has no expert_digests.json"))
    if show_experts:
        table = Table("layer", "local", "remote", "fetch", title="plan per expert", title_justify="left")
        for layer, tiers_of in sorted(plan.get("layers", {}).items(), key=lambda kv: int(kv[0])):
            table.add_row(layer, *(_ranges(tiers_of.get(t, [])) for t in ("local", "remote", "fetch")))
        console.print(table)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for i in sorted(ids):
        if out and "-" not in out[-1].split(",")[-1] and int(out[-1]) == i - 1:
            out[-1] = f"{out[-1]}-{i}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out) or "-"
