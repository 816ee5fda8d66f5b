"""Settlement roots in the DHT: ``settle --bootstrap`` publishes, ``root`` fetches and verifies,
``prove``/``check-proof --bootstrap`` check proofs against it, across a libp2p swarm on loopback.

Every DHT peer refuses a root signed by anyone but the ledger its key names, and a second,
different root for an epoch that has one (even when the ledger itself signed it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from ledger_support import MODEL, SHAPE, Clock, Peers

from moeswarm.errors import ProtocolError
from moeswarm.ledger import (
    Ledger,
    StoreConfig,
    list_receipts,
    root_record,
    settle_epoch,
)
from moeswarm.ledger.cli import main
from moeswarm.net.p2p import P2PConfig, P2PNode
from moeswarm.net.records import LedgerRoot, ledger_root_key, select_any, validate_any
from moeswarm.protocol import ErrorCode, Identity

pytestmark = pytest.mark.timeout(120)

PAST = 1_700_000_000_000  # an epoch that has ended by the real clock the CLI uses
EPOCH = PAST // 3_600_000


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[P2PNode]]:
    """Three DHT servers on loopback, bootstrapped from the first."""
    nodes: list[P2PNode] = []

    async def start() -> None:
        nodes.append(P2PNode(Identity.generate()))
        await nodes[0].start()
        for _ in range(2):
            nodes.append(P2PNode(Identity.generate(), P2PConfig(bootstrap=(nodes[0].multiaddrs[0],))))
            await nodes[-1].start()

    async def stop() -> None:
        for node in nodes:
            await node.stop()

    try:
        asyncio.run(start())
        yield nodes
    finally:
        asyncio.run(stop())


def filled_ledger(folder: Path, key: Identity, receipts: int, *, seed_peers: Peers | None = None) -> tuple[str, str]:
    """A SQLite ledger with ``receipts`` receipts in epoch EPOCH; returns (db path, key path)."""
    db, key_path = str(folder / "ledger.db"), folder / "ledger.key"
    folder.mkdir(exist_ok=True)
    key_path.write_bytes(key.seed())
    with Ledger(StoreConfig(db, create=True), key, clock=Clock(PAST + 5)) as led:
        led.register_model(MODEL, SHAPE)
        led.ingest((seed_peers or Peers()).funded(led).receipts(receipts, time_ms=PAST))
    return db, str(key_path)


async def store_at_peer(node: P2PNode, target: str, key: str, value: bytes) -> bool:
    """Push a value to ``target`` the way a peer that skips its own validator would."""
    from libp2p.peer.id import ID

    return bool(await node._call(
        lambda: node._dht.value_store._store_at_peer(ID.from_base58(target), key.encode(), value)))


def test_settle_publishes_the_root_and_volunteers_check_proofs_against_it(swarm: list[P2PNode],
                                                                         tmp_path: Path) -> None:
    key = Identity.generate()
    db, key_path = filled_ledger(tmp_path / "a", key, 5)
    boot = swarm[0].multiaddrs[0]

    code, out, err = run("settle", "--db", db, "--key", key_path, "--epoch", str(EPOCH), "--bootstrap", boot)
    assert code == 0, err
    statement = json.loads(out)
    assert "published the root" in err

    code, out, err = run("root", "--bootstrap", swarm[2].multiaddrs[0], "--ledger-peer", key.peer_id_str,
                         "--epoch", str(EPOCH))
    assert code == 0, err
    root = json.loads(out)
    assert (root["merkle_root"], root["receipts"], root["ledger"]) == (
        statement["merkle_root"], 5, key.peer_id_str)
    code, _, err = run("root", "--bootstrap", boot, "--ledger-peer", key.peer_id_str, "--epoch", str(EPOCH + 1))
    assert code == 1 and "no settlement root" in err

    with Ledger(StoreConfig(db)) as led:
        receipt_id = list_receipts(led, limit=1)[0].receipt_id.hex()
    code, out, err = run("prove", "--db", db, receipt_id, "--bootstrap", swarm[1].multiaddrs[0])
    assert code == 0 and "leads to the root in the DHT" in err, err
    proof_file = tmp_path / "proof.json"
    proof_file.write_text(out)
    code, _, err = run("check-proof", str(proof_file), "--bootstrap", boot)
    assert code == 0 and "leads to the root in the DHT" in err, err

    # The same ledger key over another set of receipts (a ledger showing a volunteer a different
    # tree): its proof verifies on its own, but not against the root the swarm holds.
    db2, _ = filled_ledger(tmp_path / "b", key, 3)
    with Ledger(StoreConfig(db2), key, clock=Clock(PAST + 3_600_000)) as led:
        settle_epoch(led, EPOCH)
        other_id = list_receipts(led, limit=1)[0].receipt_id.hex()
    code, out, _ = run("prove", "--db", db2, other_id)
    assert code == 0
    proof_file.write_text(out)
    code, _, _ = run("check-proof", str(proof_file))
    assert code == 0
    code, _, err = run("check-proof", str(proof_file), "--bootstrap", boot)
    assert code == 1 and "another tree" in err, err
    code, _, err = run("settle", "--db", db2, "--key", key_path, "--epoch", str(EPOCH), "--bootstrap", boot)
    assert code == 2 and "already has a root" in err, err


def test_forged_and_second_roots_are_refused(swarm: list[P2PNode], tmp_path: Path) -> None:
    ledger, intruder = Identity.generate(), Identity.generate()
    peers = Peers()
    roots = []
    for name, n in (("a", 4), ("b", 2)):
        db, _ = filled_ledger(tmp_path / name, ledger, n, seed_peers=peers)
        with Ledger(StoreConfig(db), ledger, clock=Clock(PAST + 3_600_000)) as led:
            roots.append(root_record(settle_epoch(led, EPOCH), ledger))
    first, second = roots
    assert first.merkle_root != second.merkle_root and first.verifies() and second.verifies()
    key = ledger_root_key(ledger.peer_id, EPOCH)
    forged = replace(first, receipts=first.receipts + 1).signed(intruder)  # the intruder's key, the ledger's slot
    tampered = replace(first, receipts=first.receipts + 1)  # the ledger's signature, other content
    own_forgery = replace(first, ledger=intruder.peer_id).signed(intruder)  # self-consistent, wrong key slot

    async def body() -> None:
        writer, reader = swarm[1], swarm[2]
        for bad, code in ((forged, ErrorCode.AUTH_FAILED), (tampered, ErrorCode.AUTH_FAILED),
                          (own_forgery, ErrorCode.AUTH_FAILED)):
            with pytest.raises(ProtocolError) as caught:
                await writer.put(key, bad.encode())
            assert caught.value.code == code
            for target in swarm:  # pushed past the writer's validator: every server refuses it
                if target is not writer:
                    assert not await store_at_peer(writer, target.peer_id, key, bad.encode())
        assert await reader.get(key) is None

        assert await writer.put(key, first.encode()) >= 1
        await writer.put(key, first.encode())  # the same bytes again: not a change, accepted
        with pytest.raises(ProtocolError) as caught:  # the ledger itself cannot change the root
            await writer.put(key, second.encode())
        assert caught.value.code == ErrorCode.STALE
        for target in swarm:
            if target is not writer:
                assert not await store_at_peer(writer, target.peer_id, key, second.encode())
        late = P2PNode(Identity.generate(), P2PConfig(bootstrap=(swarm[0].multiaddrs[0],), client_mode=True))
        async with late:  # holds nothing, so its own validator lets the second root through,
            assert await late.put(key, second.encode()) == 0  # ... but no server takes it
        for node in swarm:
            assert await node.get(key) == first.encode()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_validator_rules_for_roots() -> None:
    ledger, other = Identity.generate(), Identity.generate()
    root = LedgerRoot(ledger.peer_id, 7, bytes(range(32)), 3, bytes(32), b"\x01" * 32, PAST).signed(ledger)
    key = ledger_root_key(ledger.peer_id, 7)
    validate_any(key, root.encode())
    assert LedgerRoot.decode(root.encode()) == root
    later = replace(root, merkle_root=b"\x02" * 32, settled_ms=PAST + 1).signed(ledger)
    cases = [
        (ledger_root_key(ledger.peer_id, 8), root.encode(), None, ErrorCode.BAD_FIELD),  # another epoch's slot
        (ledger_root_key(other.peer_id, 7), root.encode(), None, ErrorCode.AUTH_FAILED),  # another ledger's slot
        (key, later.encode(), root.encode(), ErrorCode.STALE),  # immutable once stored
        (key, root.encode()[:-3], None, ErrorCode.MALFORMED_FRAME),
        (key, b"\x00" * 9000, None, ErrorCode.FRAME_TOO_LARGE),
    ]
    for k, value, stored, code in cases:
        with pytest.raises(ProtocolError) as caught:
            validate_any(k, value, stored)
        assert caught.value.code == code, (k, code)
    validate_any(key, later.encode(), b"garbage")  # a void stored value may be replaced
    assert select_any(key, [b"garbage", later.encode(), root.encode()]) == 2  # the first signed
