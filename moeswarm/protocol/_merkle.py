"""The Merkle tree of a receipt batch (v1.3), over the canonical receipt bodies in batch order.

    leaf = SHA-256("moeswarm/v1/receipt-leaf\\0" || canonical(receipt body))
    node = SHA-256("moeswarm/v1/receipt-node\\0" || left || right)

Each level pairs neighbours left to right; a level of odd width carries its last hash up
unchanged (never paired with itself, so no two leaf lists share a root). One leaf is its own
root. A path lists the sibling hashes from the leaf level up, skipping levels where the node
was carried up; its length is fixed by (index, count), which the statement signs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

LEAF_TAG = b"moeswarm/v1/receipt-leaf\0"
NODE_TAG = b"moeswarm/v1/receipt-node\0"


def leaf_hash(body: bytes) -> bytes:
    return hashlib.sha256(LEAF_TAG + body).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_TAG + left + right).digest()


def _levels(leaves: Sequence[bytes]) -> list[list[bytes]]:
    if not leaves:
        raise ValueError("a batch holds at least one receipt")
    levels = [list(leaves)]
    while len(levels[-1]) > 1:
        level = levels[-1]
        up = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            up.append(level[-1])
        levels.append(up)
    return levels


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    return _levels(leaves)[-1][0]


def merkle_paths(leaves: Sequence[bytes]) -> list[tuple[bytes, ...]]:
    """The path of every leaf, in leaf order."""
    levels = _levels(leaves)
    paths = []
    for index in range(len(leaves)):
        path, i = [], index
        for level in levels[:-1]:
            if i ^ 1 < len(level):
                path.append(level[i ^ 1])
            i //= 2
        paths.append(tuple(path))
    return paths


def path_length(index: int, count: int) -> int:
    """Sibling hashes on the path of leaf ``index`` of ``count`` (0 <= index < count)."""
    n, i, length = count, index, 0
    while n > 1:
        if i ^ 1 < n:
            length += 1
        i //= 2
        n = (n + 1) // 2
    return length


def root_from_path(leaf: bytes, index: int, count: int, path: Sequence[bytes]) -> bytes | None:
    """The root ``path`` leads to from ``leaf`` at ``index`` of ``count``; None if its length is wrong."""
    if not 0 <= index < count or len(path) != path_length(index, count):
        return None
    h, n, i, k = leaf, count, index, 0
    while n > 1:
        if i ^ 1 < n:
            sibling = path[k]
            k += 1
            h = node_hash(h, sibling) if i % 2 == 0 else node_hash(sibling, h)
        i //= 2
        n = (n + 1) // 2
    return h
