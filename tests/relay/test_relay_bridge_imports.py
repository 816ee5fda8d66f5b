"""A device running ``moeswarm bridge`` with explicit experts never loads libp2p or trio: it talks
only to its relay (the relay publishes for it).  Checked on a real bridge process serving through a
real relay, with ``python -X importtime``, which lists every module the process ever imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moeswarm.mobile_bridge import export_onnx


def test_a_bridge_with_explicit_experts_never_imports_libp2p_or_trio(
        mixtral: tuple[Path, Any], certs: Any, spawn: Any, tmp_path: Path) -> None:
    folder, _ = mixtral
    export_onnx(folder, tmp_path / "shards", experts=(0, 3))
    relay = spawn("relay", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(certs.cert),
                  "--key", str(certs.key), "--no-dht")
    url = relay.wait_ready()["url"]
    with tempfile.TemporaryFile("w+") as err:
        bridge = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "moeswarm.mobile_bridge.cli", "bridge", "--relay", url,
             "--ca", str(certs.ca), "--shards", str(tmp_path / "shards"), "--experts", "0-3"],
            stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        try:
            assert bridge.stdout is not None
            line = bridge.stdout.readline()  # the READY line: connected, announced, serving
            assert line.startswith("READY "), f"no READY line; stderr: {err.seek(0) or err.read()[-2000:]}"
            assert json.loads(line[6:])["experts"] == [0, 3]
        finally:
            bridge.terminate()
            bridge.wait(30)
            bridge.stdout.close()
        err.seek(0)
        imported = {row.rsplit("|", 1)[-1].strip().split(".")[0] for row in err if row.startswith("import time:")}
    assert "moeswarm" in imported and "onnxruntime" in imported  # the listing is complete
    assert {"libp2p", "trio"} & imported == set()
