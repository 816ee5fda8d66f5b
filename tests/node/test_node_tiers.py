"""The tier planner's moving parts: weight fetching over the data plane, and a backbone that
follows its plan (fetching experts from real node processes and computing them itself) while
giving the transformers oracle's tokens; ``moeswarm node status`` reporting live figures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_node_swarm import backbone_config, nodes, run_logits

from moeswarm.demo.swarm import expert_nodes
from moeswarm.errors import ProtocolError
from moeswarm.model import SamplingParams, generate, load_model, load_weights
from moeswarm.net.client import ExpertClient
from moeswarm.net.dataplane import DataPlaneServer, ServerConfig
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.fetch import (
    DIGESTS_FILE,
    fetch_expert,
    serve_weights,
    write_expert_digests,
)
from moeswarm.node.status import fetch_reports
from moeswarm.protocol import ErrorCode, Identity, WeightsRequest

pytestmark = pytest.mark.slow


async def _no_calls(client, request):  # type: ignore[no-untyped-def]
    raise ProtocolError("no expert calls here", code=ErrorCode.UNKNOWN_EXPERT)


@contextlib.asynccontextmanager
async def planner_over(cfg, servers, **kw):  # type: ignore[no-untyped-def]
    """A TierPlanner (links not probed) whose swarm table names ``servers`` ((identity,
    DataPlaneServer) pairs), each announcing every expert of the model "m"."""
    from moeswarm.net.routing_table import SwarmTable
    from moeswarm.node.links import LinkMonitor, ProbeConfig
    from moeswarm.node.tiers import TierPlanner
    from moeswarm.protocol import sign_announcement

    table = SwarmTable("m")
    for ident, srv in servers:
        table.update(sign_announcement(
            ident, model_id="m", layers=(0, cfg.num_layers - 1), experts=(0, cfg.num_experts - 1),
            endpoints=[srv.endpoint], capacity_bytes=1 << 30, throughput=0, load_permille=0,
            software="moeswarm/test", seq=1, expires_at_ms=int(time.time() * 1000) + 600_000))
    client_id = Identity.generate()
    links = LinkMonitor(client_id, table, ProbeConfig(interval_s=0))
    tiers = TierPlanner(cfg, table, links, self_peer=client_id.peer_id, local=None, **kw)
    try:
        yield tiers
    finally:
        await tiers.aclose()
        await links.aclose()


def test_fetched_expert_equals_the_holders_bytes_and_bad_fetches_get_codes(oracle_checkpoints) -> None:
    folder, _ = oracle_checkpoints.get("mixtral", "per_expert")
    weights = load_weights(folder)
    cfg = weights.config

    async def main() -> None:
        server_id, client_id = Identity.generate(), Identity.generate()

        async def weights_handler(client, request):  # type: ignore[no-untyped-def]
            return serve_weights(weights, "m", request)

        async with DataPlaneServer(server_id, _no_calls, ServerConfig(), weights_handler=weights_handler) as srv:
            client = await ExpertClient.connect(srv.endpoint, client_id)
            try:
                got = await fetch_expert(client, cfg, "m", 1, 5)
                held = weights.experts[1][5]
                for name in ("gate", "up", "down"):
                    assert np.array_equal(getattr(got, name), np.asarray(getattr(held, name))), name
                    assert getattr(got, name).dtype == getattr(held, name).dtype
                bad = [
                    (WeightsRequest(os.urandom(16), "m", 1, 99, "gate", 0, 1), ErrorCode.UNKNOWN_EXPERT),
                    (WeightsRequest(os.urandom(16), "other", 1, 5, "gate", 0, 1), ErrorCode.UNKNOWN_EXPERT),
                    (WeightsRequest(os.urandom(16), "m", 1, 5, "gate", 0, 10_000), ErrorCode.BAD_FIELD),
                    (WeightsRequest(os.urandom(16), "m", 1, 5, "gate_bias", 0, 1), ErrorCode.BAD_FIELD),
                ]
                for request, code in bad:
                    with pytest.raises(ProtocolError) as e:
                        await client.fetch(request, timeout=5)
                    assert e.value.code == code, request
                assert await client.ping() > 0  # the connection and the server keep serving
                again = await fetch_expert(client, cfg, "m", 0, 0)
                assert np.array_equal(again.down, np.asarray(weights.experts[0][0].down))
            finally:
                await client.aclose()

    asyncio.run(main())



def test_a_cancelled_asker_does_not_fail_the_others_waiting_on_the_same_fetch(oracle_checkpoints) -> None:
    """Concurrent asks for one expert share one fetch; the first asker's request is cancelled
    mid-fetch (its client went away), and the second still gets the holder's bytes."""
    folder, _ = oracle_checkpoints.get("mixtral", "per_expert")
    weights = load_weights(folder)
    cfg = weights.config

    async def main() -> None:
        server_id = Identity.generate()
        asked, release = asyncio.Event(), asyncio.Event()

        async def weights_handler(client, request):  # type: ignore[no-untyped-def]
            asked.set()
            await release.wait()
            return serve_weights(weights, "m", request)

        async with DataPlaneServer(server_id, _no_calls, ServerConfig(), weights_handler=weights_handler) as srv, \
                planner_over(cfg, [(server_id, srv)]) as tiers:
            first = asyncio.create_task(tiers.ensure(1, 5))
            second = asyncio.create_task(tiers.ensure(1, 5))
            async with asyncio.timeout(10):
                await asked.wait()  # the shared fetch is at the holder
            first.cancel()
            await asyncio.sleep(0.01)
            release.set()
            async with asyncio.timeout(10):
                got = await second
            assert first.cancelled()
            assert np.array_equal(got.down, np.asarray(weights.experts[1][5].down))
            assert tiers.fetched.get((1, 5)) is got

    asyncio.run(main())


def _digest_from_safetensors(folder: Path, layer: int, expert: int) -> str:
    """The digest format of ``expert_digests.json``, computed from the checkpoint as the
    safetensors package reads it (not through moeswarm's loader): SHA-256 over the format tag,
    then for gate (w1), up (w3), down (w2): "|name|dtype|dims|" and the tensor's bytes."""
    import glob
    import hashlib

    tensors: dict[str, np.ndarray] = {}
    for f in glob.glob(str(folder / "*.safetensors")):
        tensors.update(load_file(f))
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    h = hashlib.sha256(b"moeswarm-expert-digests/1")
    for name, hf in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        a = tensors[prefix + hf + ".weight"]
        h.update(f"|{name}|{a.dtype}|{','.join(map(str, a.shape))}|".encode() + a.tobytes())
    return h.hexdigest()


def test_fetched_experts_are_checked_against_the_published_digests(oracle_checkpoints, tmp_path) -> None:
    """``moeswarm expert-digests`` writes one digest per expert; a planner holding that file
    takes an honest holder's expert, and refuses a holder that changed one number of another
    (counted, nothing cached, nothing fetched from that holder again)."""
    from moeswarm.errors import BadResponse, SwarmError
    from moeswarm.node.fetch import load_expert_digests
    from moeswarm.node.links import LinkEstimate
    from moeswarm.protocol import WeightsResponse, peer_id_to_str

    folder, _ = oracle_checkpoints.get("mixtral", "per_expert")
    out = tmp_path / "digests.json"
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "expert-digests", "--model", str(folder),
                           "--out", str(out), "-q"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    weights = load_weights(folder)
    cfg = weights.config
    digests = load_expert_digests(out, cfg)
    assert digests is not None and len(digests) == sum(cfg.moe_layers) * cfg.num_experts
    assert digests[(1, 5)] == _digest_from_safetensors(folder, 1, 5)

    async def main() -> None:
        def weights_handler(tamper: bool):  # type: ignore[no-untyped-def]
            async def handler(client, request):  # type: ignore[no-untyped-def]
                response = serve_weights(weights, "m", request)
                if tamper and request.tensor == "down" and request.start == 0:
                    data = np.array(response.data)
                    data[0, 0] += np.float32(1e-3)  # one number of a whole expert
                    return WeightsResponse(response.request_id, data)
                return response
            return handler

        honest_id, bad_id = Identity.generate(), Identity.generate()
        async with DataPlaneServer(honest_id, _no_calls, ServerConfig(), weights_handler=weights_handler(False)) as a, \
                DataPlaneServer(bad_id, _no_calls, ServerConfig(), weights_handler=weights_handler(True)) as b, \
                planner_over(cfg, [(honest_id, a), (bad_id, b)], digests=digests) as tiers:
            got = await tiers.ensure(1, 5, peer=honest_id.peer_id)
            assert np.array_equal(got.down, np.asarray(weights.experts[1][5].down))
            # the rate this fetch delivered now stands beside the probe's figure in the planner's link
            tiers.links.links[honest_id.peer_id] = LinkEstimate(0.001, 1e6, 1e6, time.monotonic())
            link = tiers.link_table()[honest_id.peer_id.hex()]
            assert link.down_bps == 1e6 and link.fetch_bps == tiers.fetch_bps[honest_id.peer_id] > 0
            with pytest.raises(BadResponse, match="does not match its digest") as info:
                await tiers.ensure(0, 3, peer=bad_id.peer_id)
            assert info.value.code == ErrorCode.BAD_TENSOR
            assert tiers.fetched.get((0, 3)) is None
            assert (tiers.fetch_verified, tiers.fetch_rejected) == (1, 1)
            fetched = tiers.status()["fetched"]
            assert (fetched["checked"], fetched["verified"], fetched["rejected"]) == (True, 1, 1)
            # nothing is fetched from it again, and the plan never fetches from it; its calls still
            # count (a stale digest file must not take the holders away)
            assert tiers.table.holders[bad_id.peer_id].failures == 0
            assert fetched["not_fetched_from"] == [peer_id_to_str(bad_id.peer_id)]
            again = await tiers.ensure(0, 3, peer=bad_id.peer_id)  # asked of it: taken from the honest one
            assert np.array_equal(again.down, np.asarray(weights.experts[0][3].down))
            tiers.links.links[bad_id.peer_id] = LinkEstimate(0.001, 1e6, 1e6, time.monotonic())
            del tiers.digests[(0, 4)]  # an expert the file does not name is not fetched at all, from anyone
            with pytest.raises(SwarmError, match="not in the digest file"):
                await tiers.ensure(0, 4)
            assert not tiers.link_table()[bad_id.peer_id.hex()].fetchable
            assert tiers.link_table()[honest_id.peer_id.hex()].fetchable

    asyncio.run(main())



def test_a_broken_digest_file_is_refused_at_start(oracle_checkpoints, tmp_path) -> None:
    from moeswarm.errors import ConfigError
    from moeswarm.model import load_config
    from moeswarm.node.fetch import DIGESTS_FORMAT, load_expert_digests

    cfg = load_config(oracle_checkpoints.get("mixtral", "per_expert")[0])
    path = tmp_path / "d.json"
    assert load_expert_digests(path, cfg) is None  # no file: fetched weights go unchecked (and a warning says so)
    for text, why in [("{not json", "not an expert digest file"),
                      (json.dumps({"format": "other/9", "layers": {}}), "format is 'other/9'"),
                      (json.dumps({"format": DIGESTS_FORMAT, "layers": {"0": {"99": "0" * 64}}}), "does not have"),
                      (json.dumps({"format": DIGESTS_FORMAT, "layers": {"0": {"1": "abc"}}}), "malformed")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=why):
            load_expert_digests(path, cfg)


def backbone_only_copy(folder: Path, dest: Path) -> Path:
    """The checkpoint without any routed expert: what a backbone of a real swarm holds."""
    dest.mkdir()
    for f in folder.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v for k, v in load_file(str(f)).items() if ".experts." not in k}
            if tensors:
                save_file(tensors, str(dest / f.name))
        elif f.name.endswith(".index.json"):
            continue  # the index would name expert tensors that are not there
        elif f.is_file():
            shutil.copy(f, dest / f.name)
    return dest


def test_backbone_following_its_plan_fetches_experts_and_keeps_the_oracle_tokens(oracle_checkpoints, tmp_path,
                                                                                  monkeypatch) -> None:
    folder, ref = oracle_checkpoints.get("mixtral", "per_expert")
    expected = run_logits(load_model(folder), ref.prompt_ids, ref.decode_tokens)
    own = backbone_only_copy(Path(folder), tmp_path / "backbone")
    write_expert_digests(load_weights(folder), own / DIGESTS_FILE, model_id="published with the model")
    cfg = load_model(folder).config
    total = sum(cfg.moe_layers) * cfg.num_experts
    monkeypatch.setenv("MOESWARM_HOME", str(tmp_path / "home"))  # the nodes' run files, for `node status`

    with nodes(Path(folder), ["0-3", "4-7"]) as daemons:
        for d in daemons:  # started before this test set MOESWARM_HOME: ask them by URL
            assert d.info["status"].startswith("http://127.0.0.1:")

        async def main() -> tuple[np.ndarray, list[int], dict]:  # type: ignore[type-arg]
            config = backbone_config(own, daemons[0].info["multiaddrs"][0], tiers="auto", probe_interval_s=1.0,
                                     replan_s=0.2)
            async with SwarmBackbone(config) as bb:
                assert bb.tiers is not None and bb.executor is not None
                assert bb.tiers.local is None  # this checkpoint holds no experts
                deadline = time.monotonic() + 30  # until every expert is fetched (bounded)
                while len(bb.tiers.fetched) < total and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                status = bb.status()
                logits = await asyncio.to_thread(run_logits, bb.model, ref.prompt_ids, ref.decode_tokens)
                params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
                status["local_pairs_after"] = bb.executor.local_pairs
                return logits, tokens, status

        logits, tokens, status = asyncio.run(main())

        async def cold_tier() -> tuple[list[int], int, int, int]:
            """--tiers fetch with room for 3 experts: every miss fetches, evictions fetch again."""
            one = load_weights(folder).experts[0][0].nbytes
            config = backbone_config(own, daemons[0].info["multiaddrs"][0], tiers="fetch", fetch_cache_bytes=3 * one)
            async with SwarmBackbone(config) as bb:
                params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))
                fetched_tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
                assert bb.executor is not None and bb.tiers is not None
                return fetched_tokens, bb.tiers.fetched.fetched_bytes, bb.tiers.fetched.bytes, bb.executor.calls

        cold_tokens, fetched_bytes, held_bytes, calls = asyncio.run(cold_tier())
        urls = [d.info["status"] for d in daemons]
        deadline = time.monotonic() + 40  # nodes find each other (DHT, every 10 s) and probe (every 5 s)
        while time.monotonic() < deadline and not all(len(r.get("tiers", {}).get("links", {})) == 1
                                                      for r in fetch_reports(urls)):
            time.sleep(0.5)
        report = subprocess.run([sys.executable, "-m", "moeswarm.cli", "node", "status", "--json",
                                 *(arg for d in daemons for arg in ("--url", d.info["status"]))],
                                capture_output=True, text=True, timeout=60)

    assert np.abs(logits - expected).max() <= 1e-5
    assert tokens == ref.greedy_tokens
    assert cold_tokens == ref.greedy_tokens and calls == 0  # every expert computed here, none called
    one = load_weights(folder).experts[0][0].nbytes
    assert held_bytes <= 3 * one and fetched_bytes > total * one  # evicted experts were fetched again
    plan = status["tiers"]["plan"]
    assert plan["counts"]["fetch"] == total and status["tiers"]["fetched"]["experts"] == total, status["tiers"]
    assert status["local_pairs_after"] > 0  # the fetched copies did the work
    checks = status["tiers"]["fetched"]
    assert checks["checked"] and checks["verified"] >= total and checks["rejected"] == 0, checks
    links = status["tiers"]["links"]
    assert {d.info["peer_id"] for d in daemons} <= set(links)
    for link in links.values():
        assert link["rtt_ms"] > 0 and link["up_mbit"] > 0 and link["down_mbit"] > 0

    assert report.returncode == 0, report.stderr
    reports = json.loads(report.stdout)
    assert [r["peer_id"] for r in reports] == [d.info["peer_id"] for d in daemons]
    for r, d in zip(reports, daemons):
        assert r["role"] == "node" and r["endpoint"] == d.info["endpoint"]
        assert r["memory"]["vm_rss"] > 0 and r["tiers"]["plan"]["counts"]["local"] == total
        other = next(o for o in daemons if o is not d).info["peer_id"]
        assert other in r["tiers"]["links"]  # each node measures the other, both directions


def test_a_holder_that_refuses_fetches_is_called_instead(oracle_checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real node started with --no-weight-fetches (as a metered volunteer, or a v1.0 node, refuses
    weight fetches): a backbone with --tiers fetch gets UNKNOWN_EXPERT for every fetch, calls the
    node instead, and keeps the oracle's tokens; the node counts exactly the calls the backbone made."""
    folder, ref = oracle_checkpoints.get("mixtral", "per_expert")
    own = backbone_only_copy(Path(folder), tmp_path / "backbone")
    write_expert_digests(load_weights(folder), own / DIGESTS_FILE, model_id="published with the model")
    with expert_nodes(str(folder), ["0-7"], extra_args=lambda i: ["--no-weight-fetches"]) as daemons:

        refusals: list[object] = []  # what each fetch the backbone attempted ended with

        async def main() -> tuple[list[int], int, int, set, int]:  # type: ignore[type-arg]
            config = backbone_config(own, daemons[0].info["multiaddrs"][0], tiers="fetch")
            async with SwarmBackbone(config) as bb:
                assert bb.tiers is not None
                ensure = bb.tiers.ensure

                async def watched(layer: int, expert: int, peer: bytes | None = None):  # type: ignore[no-untyped-def]
                    try:
                        return await ensure(layer, expert, peer)
                    except Exception as e:
                        refusals.append(getattr(e, "code", e))
                        raise

                bb.tiers.ensure = watched  # type: ignore[method-assign]
                params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
                assert bb.executor is not None and bb.tiers is not None
                served = {pair for s in bb.executor.served_by.values() for pair in s}
                return tokens, bb.executor.calls, bb.tiers.fetched.fetched_bytes, served, bb.executor.local_pairs

        tokens, calls, fetched_bytes, served, local_pairs = asyncio.run(main())
        report = subprocess.run([sys.executable, "-m", "moeswarm.cli", "node", "status", "--json",
                                 "--url", daemons[0].info["status"]], capture_output=True, text=True, timeout=60)
    assert tokens == ref.greedy_tokens
    assert fetched_bytes == 0 and local_pairs == 0  # nothing came over as weights, nothing computed here
    # fetches were attempted, and every one was refused by the node (not skipped by the planner)
    assert refusals and set(refusals) == {ErrorCode.UNKNOWN_EXPERT}, refusals
    assert calls > 0 and served, (calls, served)  # every routed expert was called instead
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)[0]["serving"]["requests"] == calls


def test_metrics_of_nodes_and_backbone_and_node_status_without_urls(oracle_checkpoints, tmp_path,  # type: ignore[no-untyped-def]
                                                                    monkeypatch) -> None:
    """The README's promises: every daemon serves Prometheus figures on /metrics (a backbone with
    --tiers fetch counts the fetched experts its digests verified), and `moeswarm node status` finds
    the daemons of this machine through their run files, without --url."""
    from prometheus_client.parser import text_string_to_metric_families

    from moeswarm.demo.swarm import start_daemon, stop_daemon

    from moeswarm.demo import CHECKPOINT

    folder = CHECKPOINT  # a tokenizer too: the backbone serves text
    own = backbone_only_copy(Path(folder), tmp_path / "backbone")
    write_expert_digests(load_weights(folder), own / DIGESTS_FILE, model_id="published with the model")
    monkeypatch.setenv("MOESWARM_HOME", str(tmp_path / "home"))  # the daemons' run files

    def metrics(url: str) -> dict[str, float]:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}

    with expert_nodes(str(folder), ["0-3", "4-7"]) as daemons:
        backbone = start_daemon("backbone", ["backbone", "--model", str(own), "--bootstrap",
                                             daemons[0].info["multiaddrs"][0], "--client-mode", "--tiers", "fetch",
                                             "--http", "127.0.0.1:0"])
        try:
            body = json.dumps({"prompt": "And it came to pass", "max_tokens": 4, "temperature": 0}).encode()
            request = urllib.request.Request(backbone.info["http"] + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as r:
                assert r.status == 200
            figures = metrics(backbone.info["http"])
            nodes_figures = [metrics(d.info["status"]) for d in daemons]
            report = subprocess.run([sys.executable, "-m", "moeswarm.cli", "node", "status", "--json"],
                                    capture_output=True, text=True, timeout=120)
        finally:
            stop_daemon(backbone)
    assert figures["moeswarm_fetched_experts_verified"] >= 1 and figures["moeswarm_fetched_experts_rejected"] == 0
    assert figures["moeswarm_fetched_expert_bytes"] > 0 and figures["moeswarm_vm_rss_bytes"] > 0
    for f in nodes_figures:
        assert f["moeswarm_vm_rss_bytes"] > 0 and "moeswarm_requests_served" in f
    assert report.returncode == 0, report.stderr
    found = {(r["role"], r["peer_id"]) for r in json.loads(report.stdout)}
    assert found == {("node", d.info["peer_id"]) for d in daemons} | {("backbone", backbone.info["peer_id"])}
