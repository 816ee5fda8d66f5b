"""The swarm map against a swarm of real node processes, in headless Chromium from Debian.

Two expert nodes split the demo model's experts (0-3 and 4-7, so each holds the only replica of
its half); ``moeswarm monitor`` runs as its own process. The page must name both peers and say
healthy; after the second node is killed with SIGKILL, the same page (no reload) must paint experts
4-7 of every layer red, say broken, and show that node unreachable. The JSON API and /metrics are
checked against the same swarm, and a screenshot is kept as an artifact."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path
from typing import Any

from browser_support import chromium_page
from prometheus_client.parser import text_string_to_metric_families

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import expert_nodes, start_daemon, stop_daemon

WAIT_MS = 120_000  # bound on every wait for the page (pings run every second)
RED = [214, 45, 32]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def cell_colours(page: Any, model_id: str, layers: int, experts: int) -> list[list[list[int]]]:
    """The RGB of the middle pixel of every cell of the model's coverage map, as drawn."""
    return page.evaluate("""([modelId, layers, experts]) => {
        const canvas = document.querySelector(`[data-model="${modelId}"] canvas`);
        const zoom = canvas.width / experts;
        const ctx = canvas.getContext("2d");
        const out = [];
        for (let i = 0; i < layers; i++) {
            const row = [];
            for (let e = 0; e < experts; e++) {
                const d = ctx.getImageData(Math.floor(e * zoom + zoom / 3), Math.floor(i * zoom + zoom / 3), 1, 1).data;
                row.push([d[0], d[1], d[2]]);
            }
            out.push(row);
        }
        return out;
    }""", [model_id, layers, experts])


def test_the_map_follows_a_real_swarm_and_turns_red_when_a_sole_holder_dies(tmp_path: Path) -> None:
    artifacts = Path(os.environ.get("MOESWARM_ARTIFACTS", tmp_path))
    with expert_nodes(str(CHECKPOINT), ["0-3", "4-7"]) as (first, second):
        monitor = start_daemon("monitor", ["monitor", "--bootstrap", first.info["multiaddrs"][0], "--model",
                                           str(CHECKPOINT), "--http", "127.0.0.1:0", "--interval", "1"])
        try:
            url = monitor.info["http"]
            model_id = monitor.info["models"][0]
            peers = [first.info["peer_id"], second.info["peer_id"]]
            with chromium_page() as page:
                page.goto(url)
                for peer in peers:  # the full ID is in the DOM, a shortened one on screen
                    page.wait_for_selector(f'td[data-peer-id="{peer}"]', timeout=WAIT_MS)
                page.wait_for_selector('[data-verdict="healthy"]', timeout=WAIT_MS)
                page.wait_for_selector(f'tr[data-peer="{peers[1]}"][data-state="online"]', timeout=WAIT_MS)
                healthy = get_json(url + "/api/v1/swarm")
                healthy_metrics = metrics(url)
                layers, experts = len(healthy["models"][0]["moe_layers"]), healthy["models"][0]["num_experts"]
                assert all(c != RED for row in cell_colours(page, model_id, layers, experts) for c in row)
                page.screenshot(path=str(artifacts / "monitor-healthy.png"), full_page=True)

                second.process.kill()  # SIGKILL: no goodbye, its announcement stays in the DHT until it expires
                second.process.wait(10)
                page.wait_for_selector('[data-verdict="broken"]', timeout=WAIT_MS)
                page.wait_for_selector(f'tr[data-peer="{peers[1]}"][data-state="unreachable"]', timeout=WAIT_MS)
                colours = cell_colours(page, model_id, layers, experts)
                page.screenshot(path=str(artifacts / "monitor-broken.png"), full_page=True)
            broken = get_json(url + "/api/v1/swarm")
            broken_metrics = metrics(url)
        finally:
            stop_daemon(monitor)
    if os.environ.get("MOESWARM_README_SCREENSHOT"):  # how docs/monitor.png was made
        shutil.copy(artifacts / "monitor-broken.png", Path(__file__).resolve().parents[2] / "docs" / "monitor.png")

    model = healthy["models"][0]
    assert model["model_id"] == model_id and model["verdict"] == "healthy" and model["uncovered_experts"] == 0
    assert {n["peer_id"] for n in healthy["nodes"]} == set(peers)
    assert all(n["state"] == "online" and n["via"] == "direct" and n["rtt_ms"] > 0 for n in healthy["nodes"])
    assert model["coverage"] == [[1] * experts for _ in range(layers)]
    assert healthy_metrics[("moeswarm_swarm_experts_uncovered", (("model", model_id),))] == 0
    assert healthy_metrics[("moeswarm_swarm_nodes", (("state", "online"),))] == 2

    # the dead node's half is red in every layer, the other half is not
    for row in colours:
        assert all(c == RED for c in row[4:8]) and all(c != RED for c in row[:4]), row
    model = broken["models"][0]
    assert model["verdict"] == "broken" and model["uncovered_experts"] == layers * 4
    assert model["coverage"] == [[1] * 4 + [0] * 4 for _ in range(layers)]
    states = {n["peer_id"]: n["state"] for n in broken["nodes"]}
    assert states == {peers[0]: "online", peers[1]: "unreachable"}
    assert broken_metrics[("moeswarm_swarm_experts_uncovered", (("model", model_id),))] == layers * 4
    assert broken_metrics[("moeswarm_swarm_nodes", (("state", "unreachable"),))] == 1
    for layer in model["moe_layers"]:
        assert broken_metrics[("moeswarm_swarm_min_replicas", (("layer", str(layer)), ("model", model_id)))] == 0
