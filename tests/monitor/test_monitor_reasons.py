"""What a person sees on the swarm map (issue 33, point 6), read from the page's DOM in headless Chromium:

* a holder behind a relay whose TLS certificate the monitor does not trust is "unreachable" with the
  reason written beside it (before: only in the JSON and a hover title);
* a node announcing several blocks shows every block (before: only its first);
* the coverage map has layer and expert axes (before: a bare canvas);
* the model is called by a human name from its config.json, with its family, beside the hash id
  (before: the hash id only).

The relay is a real TLS server on loopback with a certificate from a private CA the monitor was not
given: the monitor's ping dials it through the real relay client, as a backbone would. The
announcements are signed and pass the DHT's record validation, fed to the watch without a DHT (as
tests/monitor/test_monitor_scale.py does).  On 52de96c: ``model_name`` did not exist, and the watch cut
the reason to 200 characters, before "certificate verify failed"; with this watch and 52de96c's page
(app.js, style.css) the test failed waiting 30 s for the map's axes (``.axis-corner``), and the rows
showed one block per node and the hash id as the model."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from browser_support import chromium_page

from moeswarm.demo import CHECKPOINT
from moeswarm.monitor._serve_thread import serving
from moeswarm.monitor.synthetic import NoDHT
from moeswarm.monitor.watch import SwarmWatch, WatchConfig, model_from, model_name
from moeswarm.protocol import Identity, announcement_key, decode, encode, sign_announcement, validate_record
from moeswarm.relay.devcerts import make_dev_certs

WAIT_MS = 60_000
BLOCKS = [((0, 1), (0, 3)), ((2, 3), (4, 7)), ((2, 3), (0, 0))]


@contextmanager
def untrusted_tls_server(folder: Path) -> Iterator[int]:
    """A TLS listener on loopback with a certificate of a private CA nobody was told to trust."""
    certs = make_dev_certs(folder)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs.cert, certs.key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    with ctx.wrap_socket(conn, server_side=True):
                        pass
                except (ssl.SSLError, OSError):
                    pass  # the client refuses the certificate: that is the point

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(10)
        listener.close()


def announce(watch: SwarmWatch, model_id: str, endpoint: str | None, blocks: list) -> str:
    identity = Identity.generate()
    peer = identity.peer_id_str
    (layers, experts), *more = blocks
    ann = sign_announcement(identity, model_id=model_id, layers=layers, experts=experts,
                            endpoints=(endpoint.replace("PEER", peer) if endpoint else "tcp+tls://127.0.0.1:1",),
                            capacity_bytes=1 << 30, throughput=1000, load_permille=0, software="moeswarm/0.1.0", seq=1,
                            expires_at_ms=int(time.time() * 1000) + 3_600_000, more_blocks=more)
    value = encode(ann)
    validate_record(announcement_key(model_id, layers[0], identity.peer_id), value)  # as the DHT does
    watch.models[model_id].table.update(decode(value))  # type: ignore[arg-type]
    return peer


def test_the_page_says_why_a_holder_is_unreachable_and_shows_every_block_axes_and_name(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(CHECKPOINT, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": "mistralai/Mixtral-8x7B-v0.1"}))
    model_id, cfg = model_from(str(folder))
    assert model_name(str(folder)) == "Mixtral-8x7B-v0.1"
    watch = SwarmWatch(NoDHT(), [(model_id, cfg)], WatchConfig(interval_s=3600, ping_timeout_s=5),
                       {model_id: model_name(str(folder))})
    with untrusted_tls_server(tmp_path / "certs") as port:
        relayed = announce(watch, model_id, f"relay+wss://127.0.0.1:{port}/PEER", [((0, 3), (0, 7))])
        several = announce(watch, model_id, None, BLOCKS)
        with serving(watch) as url, chromium_page() as page:
            page.goto(url)
            row = page.locator(f'tr[data-peer="{relayed}"][data-state="unreachable"]')
            row.wait_for(timeout=WAIT_MS)
            relay_row = row.inner_text()
            multi = page.locator(f'tr[data-peer="{several}"]')
            multi.wait_for(timeout=WAIT_MS)
            multi_row = multi.inner_text()
            multi_bars = multi.locator(".bar span").count()
            box = page.locator(f'[data-model="{model_id}"]')
            head = box.locator(".model-head").inner_text()
            experts_axis = [t.strip() for t in box.locator(".axis-x .tick").all_inner_texts()]
            layers_axis = [t.strip() for t in box.locator(".axis-y .tick").all_inner_texts()]
            axes_title = box.locator(".axis-corner").inner_text()
            model_cell = multi.locator("td").nth(1).inner_text()
            reason_visible = row.locator(".reason").is_visible()
            page.screenshot(path=str(Path(os.environ.get("MOESWARM_ARTIFACTS", tmp_path)) / "monitor-reasons.png"),
                            full_page=True)

    # the reason is on the page, in words, where the state is
    assert reason_visible
    assert "unreachable" in relay_row
    assert f"relay certificate for relay+wss://127.0.0.1:{port}/" in relay_row and "is not trusted" in relay_row
    assert "certificate verify failed" in relay_row, relay_row
    # every block of the node of several blocks, in words and on its bar
    for (l0, l1), (e0, e1) in BLOCKS:
        assert f"{l0}-{l1} × {e0}-{e1}" in multi_row, multi_row
    assert multi_bars == len(BLOCKS)
    assert "connection refused" in multi_row.lower() or "connect" in multi_row.lower(), multi_row  # its own reason
    # the map's axes: every expert 0-7 across, every MoE layer 0-3 down (8 x 4 cells are large enough)
    assert experts_axis == [str(e) for e in range(8)] and layers_axis == [str(i) for i in range(4)]
    assert "layer" in axes_title and "expert" in axes_title
    # the model by name and family, the hash id beside it
    assert "Mixtral-8x7B-v0.1 (mixtral)" in head and model_id in head
    assert model_cell == "Mixtral-8x7B-v0.1 (mixtral)"
