"""The Merkle tree over an epoch's receipts (RFC 9162 shape, moeswarm domain tags).

    leaf  = SHA-256("moeswarm/v1/ledger-leaf\\0" || record)
    node  = SHA-256("moeswarm/v1/ledger-node\\0" || left || right)
    empty = SHA-256("moeswarm/v1/ledger-empty\\0")

``record`` is a receipt's canonical ``countersigned_receipt`` encoding, the leaves are the
epoch's receipts in chain order, and the tree is RFC 9162's: for n > 1 leaves the left
subtree holds the largest power of two below n, the right one the rest (an odd node is
carried up, never duplicated). The distinct tags keep leaves, inner nodes and every other
hash of the project apart, so a leaf can never pass for a node (second-preimage attacks).

An inclusion proof is RFC 9162's audit path (siblings from the leaf up) with the leaf index
and tree size; ``verify_inclusion`` is its verification algorithm (RFC 9162 2.1.3.2).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

LEAF_TAG: Final = b"moeswarm/v1/ledger-leaf\0"
NODE_TAG: Final = b"moeswarm/v1/ledger-node\0"
EMPTY_ROOT: Final = hashlib.sha256(b"moeswarm/v1/ledger-empty\0").digest()


def leaf_hash(record: bytes) -> bytes:
    return hashlib.sha256(LEAF_TAG + record).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_TAG + left + right).digest()


def _levels(leaves: Sequence[bytes]) -> list[list[bytes]]:
    """Bottom-up levels; carrying an odd last node up unchanged gives exactly RFC 9162's tree."""
    levels = [list(leaves)]
    while len(levels[-1]) > 1:
        below = levels[-1]
        above = [node_hash(below[i], below[i + 1]) for i in range(0, len(below) - 1, 2)]
        if len(below) % 2:
            above.append(below[-1])
        levels.append(above)
    return levels


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """The root over leaf hashes (``leaf_hash`` of each record)."""
    return _levels(leaves)[-1][0] if leaves else EMPTY_ROOT


def inclusion_proof(leaves: Sequence[bytes], index: int) -> list[bytes]:
    """The audit path of leaf ``index``: sibling hashes from the bottom up."""
    if not 0 <= index < len(leaves):
        raise IndexError(f"leaf {index} is outside a tree of {len(leaves)}")
    path = []
    for level in _levels(leaves)[:-1]:
        sibling = index ^ 1
        if sibling < len(level):
            path.append(level[sibling])
        index //= 2
    return path


def verify_inclusion(leaf: bytes, index: int, size: int, path: Sequence[bytes], root: bytes) -> bool:
    """Whether ``path`` proves leaf hash ``leaf`` at ``index`` in a tree of ``size`` with ``root``."""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root
