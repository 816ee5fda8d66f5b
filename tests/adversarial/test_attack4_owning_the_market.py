"""Attack 4 of issue 12, owning the market, run as an attacker would.

Two DHTs (libp2p on loopback) hold the signed demand reports of the same 40 honest backbones,
each of which paid the ledger (a real ``moeswarm-ledger serve`` process, over HTTP) for the
calls it made. In the second, the attacker, its own process, came first with 64 fresh keys:
each joins the DHT as a peer and publishes a report putting all its demand on one expert, dated
299 s ahead. The market is read from both the way ``moeswarm market --ledger URL`` reads it
(``fetch_state(..., ledger_url=...)``); the share moved is the largest difference.

Before the fix (commit 7895ee0, the base of branch ``trustledger``) the market had no notion of
standing. Run there (that commit's ``fetch_state(reader, shape)``, without ``ledger_url`` and
without the operator's grants, which it does not have; the rest unchanged) this test fails at
``moved == 0.0``: the target expert's share went from 0.0016 to 1.0000 (moved 0.998), because the
DHT's provider list, read 20 at a time, held only the attacker's keys and nothing weighed them.
Now reports count by what their reporter paid the ledger, the ledger names the paying reporters
(read by key, whatever the provider list holds), and the 64 keys without standing move the
share by exactly 0. The same run reads the attacked DHT once more the way the market did before
(``fetch_state`` without ``ledger_url``: no standing) as a negative control: there the provider
list holds only fakes and the target expert gets all the demand (share 1.0000 with 64 fakes; the
attack ran with 256 until 2026-12-02, 64 take a quarter of the time and still fill the list)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest
from ledger_attack_support import attacker, start_ledger

from moeswarm.demo import CHECKPOINT
from moeswarm.ledger import Ledger, StoreConfig
from moeswarm.market import (
    MergeConfig,
    demand_key,
    fetch_state,
    model_shape,
    publish_demand,
    sign_report,
)
from moeswarm.model import load_config
from moeswarm.model.model_id import model_id_for
from moeswarm.net.p2p import P2PConfig, P2PNode
from moeswarm.protocol import (
    ExpertRequest,
    ExpertRows,
    Identity,
    countersign,
    encode,
    make_receipt,
    peer_id_from_str,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HONEST, FAKES = 40, 64  # 64 > the 20 providers a read returns: before standing they were all fakes
TARGET = (1, 6)  # (row of the MoE layers, expert) the attacker wants
READ_S = 90.0  # how long a read may be repeated until it meets every honest report (a loaded machine)


def _truth(grid: tuple[int, int]) -> np.ndarray:
    """The honest routing distribution: skewed, with the target expert rarely used."""
    rng = np.random.default_rng(4)
    truth = rng.uniform(1, 10, size=grid)
    truth[TARGET] = 0.3
    return truth / truth.sum()


def _paid_calls(clients: list[Identity], model_id: str, hidden: int, ffn: int) -> list[bytes]:
    """One countersigned receipt per honest backbone, for a call of 1..8 tokens to two experts."""
    out = []
    server = Identity.generate()
    for i, client in enumerate(clients):
        tokens = 1 + i % 8
        x = np.random.default_rng(i).standard_normal((tokens, hidden)).astype(np.float32)  # (N, H)
        rows = np.arange(tokens, dtype=np.uint32)
        request = ExpertRequest(os.urandom(16), model_id, 0, i + 1, x, (ExpertRows(0, rows), ExpertRows(1, rows)))
        outputs = np.zeros((request.pairs, hidden), dtype=np.float32)  # (P, H)
        receipt = make_receipt(server, request, outputs, client=client.peer_id,
                               expert_flops=6 * hidden * ffn * request.pairs, time_ms=int(time.time() * 1000))
        out.append(encode(countersign(client, receipt)))
    return out


async def _publish_honest(boot: str, clients: list[Identity], shape, truth: np.ndarray,  # type: ignore[no-untyped-def]
                          time_ms: int) -> None:
    async def one(i: int, ident: Identity) -> None:
        counts = np.random.default_rng(i).poisson(truth * 20_000).astype(np.float32)  # the same in every DHT
        async with P2PNode(ident, P2PConfig(bootstrap=(boot,), client_mode=True)) as node:
            await publish_demand(node, sign_report(ident, model_id=shape.model_id, layers=shape.moe_layers,
                                                   counts=counts, half_life_ms=600_000,
                                                   time_ms=time_ms, seq=1))

    for i in range(0, len(clients), 8):
        await asyncio.gather(*(one(j, clients[j]) for j in range(i, min(i + 8, len(clients)))))


def test_fake_reporters_without_standing_move_no_share(tmp_path: Path) -> None:
    import aiohttp
    import msgpack

    cfg = load_config(str(CHECKPOINT))
    model_id = model_id_for(str(CHECKPOINT), cfg)
    shape = model_shape(str(CHECKPOINT), cfg, model_id)
    truth = _truth(shape.grid)
    db, key = tmp_path / "ledger.db", tmp_path / "ledger.key"
    operator = Identity.generate()
    key.write_bytes(operator.seed())
    ledger = start_ledger(["--db", str(db), "--key", str(key), "--listen", "127.0.0.1:0",
                           "--model", f"{model_id}={cfg.hidden_size}:{cfg.moe_intermediate_size}"],
                          tmp_path / "ledger.log")
    clients = [Identity.generate() for _ in range(HONEST)]
    try:
        with Ledger(StoreConfig(str(db)), operator) as books:  # the operator funds the honest backbones
            for c in clients:
                books.grant(c.peer_id, 10**9)

        async def scenario() -> tuple[np.ndarray, np.ndarray, list[dict], int, list[int]]:
            # two swarms' DHTs: the same honest backbones publish in both; in the second the attacker
            # got there first (it only has to publish before the honest backbones' next refresh)
            clean, attacked = P2PNode(Identity.generate()), P2PNode(Identity.generate())
            await clean.start()
            await attacked.start()
            try:
                async with aiohttp.ClientSession() as http, http.post(
                        f"{ledger.url}/v1/receipts", headers={"Content-Type": "application/msgpack"},
                        data=msgpack.packb({"receipts": _paid_calls(clients, model_id, cfg.hidden_size,
                                                                    cfg.moe_intermediate_size)})) as r:
                    results = (await r.json())["results"]
                fakes = await asyncio.to_thread(
                    attacker, "stuff_demand.py", attacked.multiaddrs[0], model_id,
                    ",".join(map(str, shape.moe_layers)), str(shape.num_experts),
                    str(shape.moe_layers[TARGET[0]]), str(TARGET[1]), str(FAKES))
                # one clock for both swarms: the honest reports are byte-identical and decay alike, so
                # the share may differ between the two only by what the fakes add
                now_ms, shares, merged, blind = int(time.time() * 1000), [], [], None
                for boot in (clean, attacked):
                    addr = boot.multiaddrs[0]
                    await _publish_honest(addr, clients, shape, truth, now_ms - 60_000)
                    async with P2PNode(Identity.generate(), P2PConfig(bootstrap=(addr,), client_mode=True)) as reader:

                        async def read(enough: int, **standing: str):  # type: ignore[no-untyped-def]
                            # a read that met fewer reports than ``enough`` (a DHT lookup that timed out
                            # on a loaded machine) is read again until it meets them, for READ_S at most
                            deadline = time.monotonic() + READ_S
                            while True:
                                demand = (await fetch_state(reader, shape, now_ms=now_ms, **standing)).demand
                                if demand.reporters >= enough or time.monotonic() > deadline:
                                    return demand

                        demand = await read(HONEST, ledger_url=ledger.url)
                        shares.append(demand.share)
                        merged.append(demand.reporters)
                        if boot is attacked:  # the fakes really are in the DHT, valid, under their keys
                            # negative control: read without standing (the market before the fix)
                            blind = (await read(MergeConfig().min_reporters)).share
                            stored = 0
                            for peer in fakes["reporters"]:
                                stored += await reader.get(demand_key(model_id, peer_id_from_str(peer))) is not None
                return shares[0], shares[1], results, stored, merged, blind
            finally:
                await attacked.stop()
                await clean.stop()

        before, after, results, stored, merged, blind = asyncio.run(scenario())
    finally:
        ledger.stop()

    assert [r["status"] for r in results] == ["accepted"] * HONEST  # every honest backbone has standing
    assert stored == FAKES
    assert blind is not None and blind[TARGET] > 0.9  # the attack is live: without standing the fakes own the share
    assert merged == [HONEST, HONEST]  # both markets merged every honest report and no fake one
    moved = float(np.abs(after - before).max())
    print(f"\ntarget expert share: before {before[TARGET]:.4f}, after {FAKES} fake reporters {after[TARGET]:.4f} "
          f"(without standing {blind[TARGET]:.4f}); "
          f"largest share moved {moved}")
    assert 0.5 * np.abs(before - truth).sum() < 0.05  # the honest reports are what the market sees
    assert moved == 0.0
