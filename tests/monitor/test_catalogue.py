"""What a swarm serves (issue 31, point 3): the catalogue, read by ``moeswarm models`` and by
``moeswarm monitor`` without ``--model``, against real processes on loopback.

Two ``moeswarm node`` processes serve two different models: the demo checkpoint, and a copy of it
whose config.json gains a ``name`` (so its model id differs). A liar (its own process,
``tests/adversarial/attackers/catalogue_liar.py``) signs a catalogue entry listing two models of
its own: one whose published digest matches its id but whose holder hands out a different config
(claiming 64 experts), and one whose id and digest disagree. ``moeswarm models`` must list exactly
the two honest models (ids, names, family, shape, holders) and count the liar's two as dropped;
``--model`` narrows; ``moeswarm monitor`` with no ``--model`` must show both honest models in
headless Chromium and neither of the liar's.

Before this change neither command could do this: ``moeswarm models`` did not exist and
``moeswarm monitor`` refused to start without ``--model`` ("Missing option '--model'").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from browser_support import chromium_page

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon

pytestmark = [pytest.mark.timeout(300)]
WAIT_MS = 120_000
LIAR = Path(__file__).resolve().parents[1] / "adversarial" / "attackers" / "catalogue_liar.py"


def second_checkpoint(root: Path) -> Path:
    """The demo checkpoint under another config.json (a ``name`` added): another model id, same weights."""
    copy = root / "demo-copy"
    copy.mkdir()
    for f in CHECKPOINT.iterdir():
        if f.name != "config.json":
            (copy / f.name).symlink_to(f)
    raw = json.loads((CHECKPOINT / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, "name": "demo-copy"}, indent=2))
    return copy


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True, check=False,
                          timeout=120, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_models_and_the_monitor_list_what_the_swarm_serves_and_drop_a_liar(tmp_path: Path) -> None:
    copy = second_checkpoint(tmp_path)
    first = start_daemon("node demo", ["node", "--model", str(CHECKPOINT), "--experts", "0-7"])
    second = liar = monitor = None
    try:
        boot = first.info["multiaddrs"][0]
        second = start_daemon("node copy", ["node", "--model", str(copy), "--experts", "0-7", "--bootstrap", boot])
        liar = subprocess.Popen([sys.executable, str(LIAR), boot, str(CHECKPOINT / "config.json")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        assert liar.stdout is not None
        lies = json.loads(liar.stdout.readline())
        honest = {first.info["model_id"]: first.info["peer_id"], second.info["model_id"]: second.info["peer_id"]}
        assert len(honest) == 2

        listed = cli("models", "--bootstrap", boot, "--json")
        assert listed.returncode == 0, listed.stderr
        report = json.loads(listed.stdout)
        models = {m["model_id"]: m for m in report["models"]}
        assert set(models) == set(honest), report  # the liar's two are not listed
        for model_id, peer in honest.items():
            m = models[model_id]
            assert m["holders"] == [peer] and m["family"] == "mixtral"
            assert (m["num_layers"], m["num_experts"]) == (4, 8)
        assert models[second.info["model_id"]]["name"] == "demo-copy"
        assert models[first.info["model_id"]]["name"] == "checkpoint"  # the folder's name: the demo config has none
        # the swapped config was fetched and refused; the misnamed entry never got that far
        assert report["rejected"]["config_mismatch"] == 1 and report["rejected"]["digest_not_id"] == 1, report

        table = cli("models", "--bootstrap", boot)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].split() == ["MODEL", "ID", "NAME", "FAMILY", "LAYERS", "EXPERTS", "HOLDERS"]
        rows = {line.split()[0]: line.split()[1:] for line in lines[1:3]}
        assert rows[second.info["model_id"]] == ["demo-copy", "mixtral", "4", "8", "1"]
        assert rows[first.info["model_id"]] == ["checkpoint", "mixtral", "4", "8", "1"]
        assert lines[3] == "dropped: config_mismatch 1, digest_not_id 1"
        assert lies["swapped"] not in table.stdout and lies["misnamed"] not in table.stdout

        narrowed = json.loads(cli("models", "--bootstrap", boot, "--model", str(copy), "--json").stdout)
        assert [m["model_id"] for m in narrowed["models"]] == [second.info["model_id"]]

        monitor = start_daemon("monitor", ["monitor", "--bootstrap", boot, "--http", "127.0.0.1:0",
                                           "--interval", "1"])
        url = monitor.info["http"]
        with chromium_page() as page:
            page.goto(url)
            for model_id in honest:
                page.wait_for_selector(f'[data-model="{model_id}"] [data-verdict="healthy"]', timeout=WAIT_MS)
            for peer in honest.values():
                page.wait_for_selector(f'td[data-peer-id="{peer}"]', timeout=WAIT_MS)
            page.wait_for_function("document.getElementById('updated').textContent.includes('dropped:')",
                                   timeout=WAIT_MS)
            text = page.inner_text("body")
        assert "demo-copy (mixtral)" in text and "checkpoint (mixtral)" in text
        assert all(model_id in text for model_id in honest)
        assert lies["swapped"] not in text and lies["misnamed"] not in text
        assert "2 models from the catalogue · dropped: config_mismatch 1, digest_not_id 1" in text
        snap = get_json(url + "/api/v1/swarm")
        assert {m["model_id"] for m in snap["models"]} == set(honest)
        assert snap["catalogue"]["rejected"]["config_mismatch"] == 1
    finally:
        for daemon in (monitor, second):
            if daemon is not None:
                stop_daemon(daemon)
        if liar is not None:
            assert liar.stdin is not None and liar.stdout is not None
            liar.stdin.close()
            try:
                liar.wait(15)
            except subprocess.TimeoutExpired:
                liar.kill()
                liar.wait(5)
            liar.stdout.close()
        stop_daemon(first)
