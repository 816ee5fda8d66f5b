"""``moeswarm node --require-funded URL``: a volunteer serves only clients the ledger says can pay.

A real ledger service and a real node process on loopback; clients call the node over the data
plane (TLS) with their own keys. The unfunded client gets ``AUTH_FAILED`` before any work; the
client the operator funded is served, and its countersigned receipt is accepted and paid."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest
from ledger_process import start_ledger
from ledger_support import free_port

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.errors import ProtocolError
from moeswarm.ledger import FundedGate, GateConfig
from moeswarm.model import load_config
from moeswarm.model.model_id import model_id_for
from moeswarm.net.client import ExpertClient
from moeswarm.protocol import (
    ErrorCode,
    ExpertRequest,
    ExpertRows,
    Identity,
    countersign,
    encode,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _request(model_id: str, layer: int, hidden: int) -> ExpertRequest:
    x = np.random.default_rng(0).standard_normal((3, hidden)).astype(np.float32)  # (N, H)
    return ExpertRequest(os.urandom(16), model_id, layer, 1, x, (ExpertRows(0, np.arange(3, dtype=np.uint32)),))


def test_a_node_serves_only_funded_clients(tmp_path: Path) -> None:
    cfg = load_config(str(CHECKPOINT))
    model_id = model_id_for(str(CHECKPOINT), cfg)
    layer = next(L for L in range(cfg.num_layers) if cfg.moe_layers[L])
    db, key = tmp_path / "ledger.db", tmp_path / "ledger.key"
    key.write_bytes(Identity.generate().seed())
    ledger = start_ledger(["--db", str(db), "--key", str(key), "--listen", f"127.0.0.1:{free_port()}", "--model",
                           f"{model_id}={cfg.hidden_size}:{cfg.moe_intermediate_size}:{cfg.top_k}"],
                          tmp_path / "ledger.log")
    paying, stranger = Identity.generate(), Identity.generate()
    granted = subprocess.run([sys.executable, "-m", "moeswarm.ledger.cli", "grant", "--db", str(db), "--key",
                              str(key), paying.peer_id_str, str(10**12)], capture_output=True, text=True, check=False)
    assert granted.returncode == 0, granted.stderr
    try:
        node = start_daemon("funded node", ["node", "--model", str(CHECKPOINT), "--experts", "0-1",
                                            "--require-funded", ledger.info["url"]])
        try:
            async def calls() -> tuple[BaseException | None, object, list[dict]]:
                refused: BaseException | None = None
                stranger_client = await ExpertClient.connect(node.info["endpoint"], stranger)
                try:
                    await stranger_client.call(_request(model_id, layer, cfg.hidden_size), timeout=30)
                except ProtocolError as e:
                    refused = e
                finally:
                    await stranger_client.aclose()
                client = await ExpertClient.connect(node.info["endpoint"], paying)
                try:
                    response = await client.call(_request(model_id, layer, cfg.hidden_size), timeout=30)
                finally:
                    await client.aclose()
                body = msgpack.packb({"receipts": [encode(countersign(paying, response.receipt))]})
                async with aiohttp.ClientSession() as http, http.post(f"{ledger.info['url']}/v1/receipts",
                                                                      data=body) as r:
                    results = (await r.json())["results"]
                return refused, response, results

            refused, response, results = asyncio.run(calls())
        finally:
            stop_daemon(node)
    finally:
        ledger.stop()
    assert isinstance(refused, ProtocolError) and refused.code == ErrorCode.AUTH_FAILED
    assert "holds no credit" in str(refused)
    assert response.outputs.shape == (3, cfg.hidden_size)  # type: ignore[attr-defined]
    assert [r["status"] for r in results] == ["accepted"]
    out = subprocess.run([sys.executable, "-m", "moeswarm.ledger.cli", "balance", "--db", str(db),
                          paying.peer_id_str, "--format", "json"], capture_output=True, text=True, check=False)
    spent = json.loads(out.stdout)
    assert spent["spent"] == 6 * cfg.hidden_size * cfg.moe_intermediate_size * 3 == 10**12 - spent["balance"]


def test_the_gate_fails_closed_while_the_ledger_is_unreachable() -> None:
    async def main() -> tuple[bool, int]:
        gate = FundedGate(f"http://127.0.0.1:{free_port()}", GateConfig(timeout_s=2))

        async def handler(client: bytes, request: object) -> str:
            return "served"

        gated = gate.wrap(handler)
        try:
            await gated(Identity.generate().peer_id, None)
        except ProtocolError as e:
            assert e.code == ErrorCode.AUTH_FAILED
        funded = await gate.funded(Identity.generate().peer_id)
        await gate.aclose()
        return funded, gate.refused

    assert asyncio.run(main()) == (False, 1)
