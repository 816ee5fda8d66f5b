"""The volunteer page (issue 18): a browser tab in Debian's headless Chromium as a relay device.

The relay runs as a process serving the page, its modules, the vendored onnxruntime-web and an
``export-onnx`` folder; the page keeps its key in IndexedDB, downloads and checks the shards, opens
its device session and serves experts with onnxruntime-web. It must pass the same conformance
suite (``conformance.py device``, run as a process) as the Python bridge, and its receipts must
pass the ledger's checks."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest
from browser_device import BrowserDevice

from moeswarm.ledger._chain import ModelShape, content_problem
from moeswarm.mobile_bridge import export_onnx
from moeswarm.protocol import Receipt, peer_id_from_str, verify_receipt

REPO = Path(__file__).resolve().parents[2]


def receipt_of(hex_body: str) -> Receipt:
    m = msgpack.unpackb(bytes.fromhex(hex_body), raw=False)
    return Receipt(**{k: tuple(v) if k == "experts" else v for k, v in m.items()})


def get(url: str, ca: Path) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(url, context=ssl.create_default_context(cafile=str(ca)), timeout=30) as r:
        return r.status, dict(r.headers), r.read()


async def edge_cases(conf: Any, endpoint: str, ca: str, shards: Path, model_id: str, hidden: int) -> dict[str, Any]:
    """What the device answers, through the relay, to the cases README section 9 and 12 define."""
    import numpy as np

    from moeswarm.mobile_bridge import OnnxShards
    from moeswarm.protocol import (
        ClientHandshake,
        Error,
        ExpertRequest,
        ExpertResponse,
        ExpertRows,
        Identity,
        Ping,
        Pong,
        check_response,
        decode,
        frame,
    )

    url, device = conf.parse_relay_endpoint(endpoint)
    seen: dict[str, Any] = {}

    async def receive(ws: Any) -> Any:
        return decode((await ws.receive_bytes(timeout=30))[4:])

    http, ws = await conf.open_client(url, ca)  # a ping before the handshake: 12, and the stream ends
    try:
        await ws.send_bytes(frame(Ping(1)))
        seen["ping before hello"] = (await receive(ws)).code
        seen["then closed"] = (await ws.receive(timeout=30)).type.name
    finally:
        await ws.close()
        await http.close()
        await asyncio.sleep(0.25)  # aiohttp: let the TLS transport finish closing before the loop ends
    client = Identity.generate()
    http, ws = await conf.open_client(url, ca)
    try:
        hs = ClientHandshake(client, expected_server=device)
        await ws.send_bytes(frame(hs.hello))
        await ws.send_bytes(frame(hs.receive_ack(await receive(ws))))
        x = np.random.default_rng(0).standard_normal((3, hidden)).astype(np.float32)
        seq = int(time.time() * 1e6)
        request = ExpertRequest(os.urandom(16), model_id, 0, seq, x,
                                (ExpertRows(2, np.array([0, 2], np.uint32)), ExpertRows(1, np.array([1, 2], np.uint32))))
        await ws.send_bytes(frame(request))
        response = await receive(ws)
        assert isinstance(response, ExpertResponse), response
        check_response(request, response, client=client.peer_id, server=device)
        native = OnnxShards(shards).run(0, {2: x[[0, 2]], 1: x[[1, 2]]})  # onnxruntime, natively
        seen["max |browser - native|"] = float(np.abs(response.outputs - np.concatenate([native[2], native[1]])).max())
        await ws.send_bytes(frame(request))  # the same seq again
        again = await receive(ws)
        seen["same seq"] = (again.code, again.request_id == request.request_id)
        import ml_dtypes
        bf16 = ExpertRequest(os.urandom(16), model_id, 0, seq + 1, x.astype(ml_dtypes.bfloat16), request.experts)
        await ws.send_bytes(frame(bf16))
        r16 = await receive(ws)
        check_response(bf16, r16, client=client.peer_id, server=device)
        seen["bf16 outputs"] = str(r16.outputs.dtype)
        wide = ExpertRequest(os.urandom(16), model_id, 0, seq + 2, np.zeros((1, hidden + 1), np.float32),
                             (ExpertRows(1, np.array([0], np.uint32)),))
        await ws.send_bytes(frame(wide))
        seen["hidden size + 1"] = (await receive(ws)).code
        other = ExpertRequest(os.urandom(16), model_id, 99, seq + 3, x[:1], (ExpertRows(1, np.array([0], np.uint32)),))
        await ws.send_bytes(frame(other))
        seen["layer 99"] = (await receive(ws)).code
        body = msgpack.packb({"type": "no_such_message"})
        await ws.send_bytes(len(body).to_bytes(4, "big") + body)
        unknown = await receive(ws)
        await ws.send_bytes(frame(Ping(7)))
        pong = await receive(ws)
        seen["unknown type, then ping"] = (unknown.code, isinstance(pong, Pong) and pong.ts == 7)
        await ws.send_bytes(b"\0\0\0\1\xc1")  # 0xc1 is never used in msgpack
        garbage = await receive(ws)
        seen["garbage body"] = (garbage.code, isinstance(garbage, Error))
        seen["then closed "] = (await ws.receive(timeout=30)).type.name
    finally:
        await ws.close()
        await http.close()
        await asyncio.sleep(0.25)  # aiohttp: let the TLS transport finish closing before the loop ends
    return seen


def test_relay_serves_the_volunteer_page_its_assets_and_shards(certs: Any, spawn: Any, mixtral: tuple[Path, Any],
                                                               tmp_path: Path) -> None:
    folder, _ = mixtral
    export_onnx(folder, tmp_path / "shards", experts=(1, 2))
    relay = spawn("relay", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(certs.cert), "--key",
                  str(certs.key), "--no-dht", "--volunteer-shards", str(tmp_path / "shards"))
    base = "https" + relay.wait_ready()["url"][3:]
    status, headers, body = get(f"{base}/volunteer/", certs.ca)
    assert status == 200 and b"Volunteer this device" in body
    assert headers["Cross-Origin-Opener-Policy"] == "same-origin"
    assert headers["Cross-Origin-Embedder-Policy"] == "require-corp"
    config = json.loads(get(f"{base}/volunteer/config.json", certs.ca)[2])
    port = int(relay.info["url"].rsplit(":", 1)[1])
    der = ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate(("127.0.0.1", port)))  # what TLS presents
    assert config["binding_hex"] == hashlib.sha256(der).hexdigest()  # the relay's tls-server-end-point
    assert config["relay_url"] == relay.info["url"] and config["shards_url"] == "/volunteer/shards/"
    wasm = get(f"{base}/volunteer/vendor/onnxruntime-web/ort-wasm-simd-threaded.wasm", certs.ca)
    assert wasm[1]["Content-Type"] == "application/wasm" and wasm[2][:4] == b"\0asm"
    manifest = json.loads(get(f"{base}/volunteer/shards/manifest.json", certs.ca)[2])
    assert manifest["experts"] == [1, 2]
    bare = spawn("bare", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(certs.cert), "--key",
                 str(certs.key), "--no-dht")  # no --volunteer-shards: the page says so instead of failing obscurely
    with BrowserDevice("https" + bare.wait_ready()["url"][3:] + "/volunteer/", expect_error=True) as page:
        assert "offers no experts" in page.info["error"]
        # what a person sees: the status line says it failed, and why
        assert page.info["shown"]["state"].startswith("failed: ") and "offers no experts" in page.info["shown"]["state"]
    for outside in ("shards/../../../etc/passwd", "shards/%2e%2e/%2e%2e/__init__.py", "js/../../__init__.py",
                    "vendor/%2e%2e/%2e%2e/volunteer.py"):
        with pytest.raises(urllib.error.HTTPError) as e:
            get(f"{base}/volunteer/{outside}", certs.ca)
        e.value.close()
        assert e.value.code == 404, outside


def assert_shown(shown: dict[str, str], peer_id: str, endpoint: str, model_id: str, experts: str) -> None:
    """The page tells a person what the tab is doing: volunteering, as which device, reachable where,
    holding which experts (rendered text, not JavaScript state)."""
    assert shown["state"] == "volunteering", shown
    assert shown["peer"] == peer_id and shown["endpoint"] == endpoint, shown
    assert re.match(rf"{re.escape(model_id)}: layers \d+-\d+, experts {experts} \(\d+\.\d MiB, \w+\)$",
                    shown["holding"]), shown


def test_browser_device_passes_the_conformance_suite_and_its_receipts_verify(
        conformance: Any, certs: Any, spawn: Any, mixtral: tuple[Path, Any], tmp_path: Path) -> None:
    folder, _ = mixtral
    manifest = export_onnx(folder, tmp_path / "shards", experts=(1, 2))
    relay = spawn("relay", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(certs.cert), "--key",
                  str(certs.key), "--no-dht", "--volunteer-shards", str(tmp_path / "shards"))
    url = relay.wait_ready()["url"]
    with BrowserDevice("https" + url[3:] + "/volunteer/") as device:
        endpoint = device.info["endpoint"]
        assert endpoint == f"relay+{url}/{device.info['peer_id']}"
        assert_shown(device.info["shown"], device.info["peer_id"], endpoint, manifest.model_id, "1, 2")
        done = subprocess.run(  # the command line any implementer runs against a device
            [sys.executable, str(REPO / "tests/relay/conformance.py"), "device", endpoint, "--model-id",
             manifest.model_id, "--layer", "0", "--expert", "2", "--hidden", str(manifest.hidden_size),
             "--ca", str(certs.ca)], capture_output=True, text=True, timeout=180)
        print(done.stdout)
        assert done.returncode == 0 and done.stdout.count("PASS") == 4, done.stdout + done.stderr + str(device.console)
        stats = device.call(lambda page: page.evaluate(
            "({calls: window.volunteer.device.stats.calls, receipts: window.volunteer.device.stats.receipts,"
            " calls_shown: document.getElementById('calls').innerText})"))
        assert stats["calls"] == 1 and stats["calls_shown"] == "1"
        # the same identity after a reload: the key lives in IndexedDB
        again = device.call(lambda page: (page.reload(), page.wait_for_function(
            "() => window.volunteer && window.volunteer.state === 'volunteering'", timeout=240_000),
            page.evaluate("window.volunteer.identity.peerIdStr"))[2], timeout=300)
        assert again == device.info["peer_id"]
        extractable = device.call(lambda page: page.evaluate("window.volunteer.identity.privateKey.extractable"))
        assert extractable is False
        seen = asyncio.run(edge_cases(conformance, endpoint, str(certs.ca), tmp_path / "shards", manifest.model_id,
                                      manifest.hidden_size))
    print(seen)
    assert seen.pop("max |browser - native|") < 1e-5
    assert seen == {"ping before hello": 12, "then closed": "CLOSE", "same seq": (14, True), "bf16 outputs": "bfloat16",
                    "hidden size + 1": 5, "layer 99": 7, "unknown type, then ping": (11, True),
                    "garbage body": (1, True), "then closed ": "CLOSE"}
    receipt_hex = stats["receipts"][0]
    receipt = receipt_of(receipt_hex)
    assert receipt.server == peer_id_from_str(device.info["peer_id"])
    assert receipt.model_id == manifest.model_id and receipt.layer == 0 and receipt.experts == (2,)
    verify_receipt(receipt)  # the server signature, as clients and the ledger check it
    assert content_problem(receipt, {manifest.model_id: ModelShape(manifest.hidden_size,
                                                                  manifest.intermediate_size)}) is None



def test_bridge_web_serves_the_page_for_a_private_swarm(certs: Any, spawn: Any, mixtral: tuple[Path, Any],
                                                        tmp_path: Path) -> None:
    """``moeswarm bridge --web``: the page comes from the bridge's own server, with the relay's
    binding read from the relay's TLS; the browser dials the relay and serves through it."""
    folder, _ = mixtral
    manifest = export_onnx(folder, tmp_path / "shards", experts=(1, 2))
    relay = spawn("relay", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(certs.cert), "--key",
                  str(certs.key), "--no-dht")  # serves no shards itself
    url = relay.wait_ready()["url"]
    web = spawn("web", "moeswarm.mobile_bridge.cli", "bridge", "--relay", url, "--ca", str(certs.ca), "--shards",
                str(tmp_path / "shards"), "--web", "127.0.0.1:0", "--web-cert", str(certs.cert), "--web-key",
                str(certs.key))
    page_url = web.wait_ready()["url"]
    assert page_url.startswith("https://127.0.0.1:") and not page_url.startswith("https" + url[3:])
    with BrowserDevice(page_url) as device:
        endpoint = device.info["endpoint"]
        assert endpoint == f"relay+{url}/{device.info['peer_id']}"
        assert_shown(device.info["shown"], device.info["peer_id"], endpoint, manifest.model_id, "1, 2")
        done = subprocess.run(
            [sys.executable, str(REPO / "tests/relay/conformance.py"), "device", endpoint, "--model-id",
             manifest.model_id, "--layer", "0", "--expert", "1", "--hidden", str(manifest.hidden_size),
             "--ca", str(certs.ca)], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0 and done.stdout.count("PASS") == 4, done.stdout + done.stderr
        device.call(lambda page: page.click("#stop"))
        state = device.call(lambda page: (page.wait_for_function(
            "() => window.volunteer.state === 'stopped'", timeout=30_000), page.inner_text("#state"))[1])
        assert state == "stopped"  # as the page shows it
    port = int(url.rsplit(":", 1)[1])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the stop button ended the device's session at the relay
        health = json.loads(get(f"https://127.0.0.1:{port}/healthz", certs.ca)[2])
        if health["devices"] == 0:
            break
        time.sleep(0.2)
    assert health["devices"] == 0, health


@pytest.mark.slow
def test_a_swarm_with_experts_held_only_by_a_browser_generates_the_engine_tokens(
        certs: Any, spawn: Any, mixtral: tuple[Path, Any], tmp_path: Path) -> None:
    """An expert node (experts 0-3), a relay in the DHT, a browser tab holding experts 4-7 and a
    backbone in this process: greedy generation equals the oracle's tokens, and every receipt the
    browser signed passes the ledger's intake checks (both signatures, FLOPs bound)."""
    import asyncio

    from moeswarm.daemon import SwarmConfig
    from moeswarm.ledger._chain import Prepared, prepare
    from moeswarm.model import SamplingParams, generate
    from moeswarm.node.backbone import SwarmBackbone
    from moeswarm.node.config import BackboneConfig
    from moeswarm.node.dispatch import DispatchConfig
    from moeswarm.protocol import CountersignedReceipt
    from moeswarm.relay import set_relay_ca

    folder, ref = mixtral
    manifest = export_onnx(folder, tmp_path / "shards", experts=(4, 7))
    node = spawn("node", "moeswarm.cli", "node", "--model", str(folder), "--experts", "0-3")
    boot = node.wait_ready()["multiaddrs"][0]
    relay = spawn("relay", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(certs.cert), "--key",
                  str(certs.key), "--bootstrap", boot, "--volunteer-shards", str(tmp_path / "shards"))
    url = relay.wait_ready()["url"]
    set_relay_ca(str(certs.ca))
    params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))
    with BrowserDevice("https" + url[3:] + "/volunteer/") as device:
        browser = peer_id_from_str(device.info["peer_id"])

        async def main() -> tuple[list[int], set[bytes], list[CountersignedReceipt], int]:
            config = BackboneConfig(SwarmConfig(str(folder), bootstrap=(boot,), client_mode=True),
                                    coverage_timeout_s=90, discovery_interval_s=1.0,
                                    dispatch=DispatchConfig(timeout_s=60.0))
            receipts: list[CountersignedReceipt] = []
            async with SwarmBackbone(config) as bb:
                assert bb.model is not None and bb.executor is not None
                bb.executor.receipts = receipts.append
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ref.prompt_ids, params)))  # type: ignore[arg-type]
                await bb.executor.flush_receipts()  # v1.3: unbatched receipts too
                return tokens, set(bb.executor.served_by), receipts, bb.executor.bad_receipts

        tokens, used, receipts, bad = asyncio.run(main())
        served = device.call(lambda page: page.evaluate("window.volunteer.device.stats.calls"))
        shot = REPO / "docs/volunteer.png" if os.environ.get("MOESWARM_README_SCREENSHOT") else Path(
            os.environ.get("MOESWARM_ARTIFACTS", tempfile.gettempdir())) / "volunteer.png"  # the README's: on request
        device.call(lambda page: page.screenshot(path=str(shot)))
    assert tokens == ref.greedy_tokens
    assert browser in used and bad == 0
    mine = [cr for cr in receipts if cr.receipt.server == browser]
    assert mine and len(mine) == served, (len(mine), served)
    shapes = {manifest.model_id: ModelShape(manifest.hidden_size, manifest.intermediate_size)}
    for cr in mine:
        assert set(cr.receipt.experts) <= {4, 5, 6, 7}
        checked = prepare(cr, shapes)
        assert isinstance(checked, Prepared), checked


@pytest.mark.slow
def test_bridge_web_with_experts_auto_gives_phones_the_markets_edge_block(certs: Any, spawn: Any,
                                                                          tmp_path: Path) -> None:
    """``bridge --web --experts auto --capacity``: the market assigns the page the block an edge
    device of that capacity should hold (what the swarm lacks: experts 4-7 here, a node holds 0-3);
    the browser serves it and announces it."""
    from moeswarm.demo import CHECKPOINT
    from moeswarm.model import load_config

    cfg = load_config(CHECKPOINT)
    expert_fp32 = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    capacity = 16 * expert_fp32 + expert_fp32 // 2  # 4 layers x 4 experts as fp32
    node = spawn("node", "moeswarm.cli", "node", "--model", str(CHECKPOINT), "--experts", "0-3")
    boot = node.wait_ready()["multiaddrs"][0]
    relay = spawn("relay", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(certs.cert), "--key",
                  str(certs.key), "--bootstrap", boot)
    url = relay.wait_ready()["url"]
    web = spawn("web", "moeswarm.mobile_bridge.cli", "bridge", "--relay", url, "--ca", str(certs.ca), "--model",
                str(CHECKPOINT), "--experts", "auto", "--bootstrap", boot, "--capacity", str(capacity),
                "--shards-cache", str(tmp_path / "cache"), "--web", "127.0.0.1:0", "--web-cert", str(certs.cert),
                "--web-key", str(certs.key))
    page_url = web.wait_ready(120)["url"]
    with BrowserDevice(page_url) as device:
        holding = device.info["shown"]["holding"]
        served = device.call(lambda page: page.evaluate(
            "[window.volunteer.device.shards.moeLayers, window.volunteer.device.shards.served(0)]"))
    assert served == [[0, 1, 2, 3], [4, 5, 6, 7]], (served, holding)
    assert re.match(r".+: layers 0-3, experts 4, 5, 6, 7 \(\d+\.\d MiB, \w+\)$", holding), holding  # as shown
