"""v1.3 receipt batches: the vectors checked against an independent reading of the spec (hashlib,
msgpack and ``cryptography``'s Ed25519, not the project's Merkle code), and the checks a client
and the ledger run on a batch (forged, altered, reordered, misplaced receipts refused)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from moeswarm import protocol as p
from moeswarm.errors import BadResponse

CLIENT = p.Identity.from_seed(bytes(range(32)))
SERVER = p.Identity.from_seed(bytes(range(32, 64)))
OTHER = p.Identity.from_seed(bytes(range(64, 96)))


def _spec_root(leaves: list[bytes]) -> bytes:
    """Section 10's tree, written from its text: pair neighbours, carry an odd last one up."""
    level = leaves
    while len(level) > 1:
        nxt = [hashlib.sha256(b"moeswarm/v1/receipt-node\0" + level[i] + level[i + 1]).digest()
               for i in range(0, len(level) - 1, 2)]
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def test_batch_vectors_follow_the_spec(load_vector: Callable[[str], Any]) -> None:
    h = load_vector("hashes.json")["receipt_batch"]
    batch = load_vector("messages/receipt_batch.json")
    bodies = [bytes.fromhex(b) for b in h["bodies_hex"]]
    wire = msgpack.unpackb(bytes.fromhex(batch["body_hex"]), raw=False)
    assert [msgpack.packb(r, use_bin_type=True) for r in wire["receipts"]] == bodies  # the bodies as sent
    leaves = [hashlib.sha256(b"moeswarm/v1/receipt-leaf\0" + b).digest() for b in bodies]
    assert [x.hex() for x in leaves] == h["leaves_hex"]
    root = _spec_root(leaves)
    assert root.hex() == h["root_hex"] == wire["statement"]["root"].hex()
    assert wire["statement"]["count"] == len(bodies) == 3
    # leaf 2 of 3 is carried up at the first level: its path has one hash, the others two
    assert [len(x) for x in h["paths_hex"]] == [2, 2, 1]
    statement = {k: wire["statement"][k] for k in ("client", "count", "root", "server")}
    signed = b"moeswarm/v1/receipt-batch\0" + msgpack.packb(statement, use_bin_type=True)
    server_key = Ed25519PublicKey.from_public_bytes(wire["statement"]["server"][6:])  # peer ID = 6-byte prefix + key
    server_key.verify(wire["statement"]["sig"], signed)
    record = msgpack.unpackb(bytes.fromhex(load_vector("messages/batched_receipt.json")["body_hex"]), raw=False)
    assert record["index"] == 1 and msgpack.packb(record["receipt"], use_bin_type=True) == bodies[1]
    assert [x.hex() for x in record["path"]] == h["paths_hex"][1]
    client_key = Ed25519PublicKey.from_public_bytes(record["statement"]["client"][6:])
    client_key.verify(record["client_sig"], b"moeswarm/v1/receipt-batch-countersign\0"
                      + msgpack.packb(statement, use_bin_type=True) + wire["statement"]["sig"])


def _request(i: int) -> p.ExpertRequest:
    hidden = np.full((2, 4), i + 1, np.float32)
    return p.ExpertRequest(bytes([i]) * 16, "org/m", 3, 100 + i, hidden,
                           (p.ExpertRows(1, np.array([0, 1], np.uint32)),))


def _batch(n: int) -> tuple[list[p.ExpertRequest], list[np.ndarray], p.ReceiptBatch]:
    requests = [_request(i) for i in range(n)]
    outputs = [np.full((2, 4), -i, np.float32) for i in range(n)]
    receipts = [p.make_receipt(SERVER, r, o, client=CLIENT.peer_id, expert_flops=96, time_ms=1, sign=False)
                for r, o in zip(requests, outputs)]
    return requests, outputs, p.sign_batch(SERVER, CLIENT.peer_id, receipts)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_every_batched_receipt_proves_its_place(n: int) -> None:
    requests, outputs, batch = _batch(n)
    for req, out, r in zip(requests, outputs, batch.receipts):
        p.check_receipt(req, out, r, client=CLIENT.peer_id, server=SERVER.peer_id)
    records = p.countersign_batch(CLIENT, p.decode(p.encode(batch)))  # type: ignore[arg-type]
    assert len({r.client_sig for r in records}) == 1  # one countersignature for the whole batch
    for br in records:
        again = p.decode(p.encode(br))
        assert isinstance(again, p.BatchedReceipt)
        assert p.batched_problem(again) is None


def test_a_batch_altered_after_signing_is_not_countersigned() -> None:
    _, _, batch = _batch(4)
    inflated = replace(batch, receipts=(replace(batch.receipts[0], expert_flops=10**12), *batch.receipts[1:]))
    with pytest.raises(BadResponse, match="Merkle root"):
        p.countersign_batch(CLIENT, inflated)
    forged = replace(batch, statement=replace(batch.statement, sig=OTHER.sign("receipt-batch", b"x")))
    with pytest.raises(BadResponse, match="signature") as info:
        p.countersign_batch(CLIENT, forged)
    assert info.value.code == p.ErrorCode.AUTH_FAILED


def test_the_ledger_checks_refuse_what_the_signatures_do_not_cover() -> None:
    _, _, batch = _batch(5)
    records = p.countersign_batch(CLIENT, batch)
    br = records[2]
    assert p.batched_problem(replace(br, receipt=replace(br.receipt, expert_flops=br.receipt.expert_flops * 2))) \
        == "bad_batch_proof"  # inflated after signing
    assert p.batched_problem(replace(br, index=3, path=records[3].path)) == "bad_batch_proof"  # another leaf's place
    assert p.batched_problem(replace(br, statement=replace(br.statement, count=6))) \
        == "bad_server_signature"  # the count is signed
    assert p.batched_problem(replace(br, client_sig=OTHER.sign("receipt-batch-countersign", b"x"))) \
        == "bad_client_signature"
    other_server = replace(br.statement, server=OTHER.peer_id)
    assert p.batched_problem(replace(br, statement=other_server, receipt=replace(br.receipt, server=OTHER.peer_id))) \
        in ("bad_batch_proof", "bad_server_signature")


def test_a_batch_of_someone_else_is_not_ours_to_countersign() -> None:
    _, _, batch = _batch(2)
    with pytest.raises(Exception, match="only the batch's client"):
        p.countersign_batch(OTHER, batch)


def test_receipt_bodies_are_written_in_canonical_key_order() -> None:
    """``receipt_body`` writes its keys in order instead of sorting them (it is made for every
    call, twice a side): that order is the canonical one, so its bytes are the canonical encoding."""
    from moeswarm.protocol._codec import receipt_body

    _, _, batch = _batch(1)
    body = receipt_body(batch.receipts[0])
    assert list(body) == sorted(body, key=lambda k: k.encode("utf-8"))
    assert msgpack.packb(body, use_bin_type=True) == p.canonical(body)
