"""Settlement roots in the swarm's DHT: publish a settled epoch's signed root, fetch it, and check
an inclusion proof against it, so a volunteer need not trust the ledger's own server.

The record and its validation belong to the swarm (``moeswarm.net.records.LedgerRoot``, under
``/moeswarm/v1/ledger/<ledger peer>/epoch/<n>``; every DHT peer runs that one validator, which
stores a root only when the ledger signed it and never replaces it with another). The node
package and libp2p are imported on use: ``import moeswarm.ledger`` loads neither.

    root = await publish_root(statement, identity, bootstrap)     # after settle_epoch
    root = await fetch_root(ledger_peer_id, epoch, bootstrap)     # None if nobody holds one
    problem = root_problem(proof, root)                           # None when the proof matches
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from moeswarm.errors import ConfigError, ProtocolError
from moeswarm.protocol import ErrorCode, Identity, peer_id_to_str

from ._settle import Statement
from ._settlement import Proof

if TYPE_CHECKING:
    from moeswarm.net.records import LedgerRoot


def root_record(statement: Statement, identity: Identity) -> LedgerRoot:
    """The compact signed root of a settlement statement (deterministic: re-signing gives the same bytes)."""
    from moeswarm.net.records import LedgerRoot  # noqa: PLC0415 - see the module docstring

    if identity.peer_id != statement.ledger:
        raise ConfigError("only the ledger's own key signs its settlement roots")
    return LedgerRoot(statement.ledger, statement.epoch, statement.merkle_root, statement.receipts,
                      statement.chain_hash, hashlib.sha256(statement.encode()).digest(),
                      statement.settled_ms).signed(identity)


@contextlib.asynccontextmanager
async def _client(bootstrap: Sequence[str]) -> AsyncIterator[Any]:
    """A short-lived DHT client node (a fresh key: the record, not the node, carries the ledger's)."""
    from moeswarm.net.p2p import P2PConfig, P2PNode  # noqa: PLC0415 - see the module docstring

    if not bootstrap:
        raise ConfigError("reaching the DHT needs a --bootstrap peer (a multiaddr ending in /p2p/<peer id>)")
    async with P2PNode(Identity.generate(), P2PConfig(bootstrap=tuple(bootstrap), client_mode=True)) as node:
        yield node


async def publish_root(statement: Statement, identity: Identity, bootstrap: Sequence[str]) -> tuple[LedgerRoot, int]:
    """Store the statement's root in the DHT; returns it and how many peers newly stored it (0 when
    every peer reached already held it). ``ProtocolError`` (code 14) if the epoch has another root:
    the peers would refuse this one, and say nothing about it."""
    from moeswarm.net.records import ledger_root_key  # noqa: PLC0415

    root = root_record(statement, identity)
    key, value = ledger_root_key(root.ledger, root.epoch), root.encode()
    async with _client(bootstrap) as node:
        held = await node.get(key)  # a fresh node holds nothing: this is the swarm's answer
        if held is not None and held != value:
            raise ProtocolError(f"epoch {root.epoch} already has a root in the DHT, and roots are immutable: "
                                "this ledger database is not the one that published it", code=ErrorCode.STALE)
        stored = await node.put(key, value)
    return root, stored


async def fetch_root(ledger: bytes, epoch: int, bootstrap: Sequence[str]) -> LedgerRoot | None:
    """The ledger's root of ``epoch`` from the DHT (validated: signed by ``ledger``), or None."""
    from moeswarm.net.records import ledger_root_key, validate_ledger_root  # noqa: PLC0415

    key = ledger_root_key(ledger, epoch)
    async with _client(bootstrap) as node:
        value = await node.get(key)
    return validate_ledger_root(key, value) if value is not None else None


def root_problem(proof: Proof, root: LedgerRoot | None) -> str | None:
    """What keeps ``proof`` from matching the DHT root of its epoch, or None. Check the proof
    itself first (``check_proof``): this compares only the tree it leads to."""
    if root is None:
        return f"the DHT holds no settlement root for epoch {proof.epoch}"
    if not root.verifies():
        raise ProtocolError("the DHT root's signature does not verify")  # validated on fetch: a bug
    if root.epoch != proof.epoch:
        return f"the DHT root is of epoch {root.epoch}, the proof of epoch {proof.epoch}"
    if (root.merkle_root, root.receipts) != (proof.merkle_root, proof.tree_size):
        return (f"the proof leads to another tree ({proof.tree_size} receipts, root {proof.merkle_root.hex()[:16]}) "
                f"than the DHT root of {peer_id_to_str(root.ledger)} ({root.receipts} receipts, root "
                f"{root.merkle_root.hex()[:16]})")
    st = proof.statement
    if st is not None and hashlib.sha256(st.encode()).digest() != root.statement_hash:
        return "the proof's settlement statement is not the one whose root is in the DHT"
    return None
