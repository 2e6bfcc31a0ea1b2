"""Merkle trees over a receipt's window leaves: the root, an inclusion path, and its check.

Owns: ``leaf_hash``, ``node_hash``, ``root``, ``path``, ``verify`` and ``Tree``: RFC 6962's tree with
BLAKE2b-256 (the leaves are ``swarm.openings``'; the tree and why: docs/protocol.md, "Openable receipts").
Pure: bytes in, bytes out; the standard library only.
"""

from __future__ import annotations

import hashlib

HASH_BYTES = 32
_LEAF, _NODE = b"\x00", b"\x01"


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def leaf_hash(data: bytes) -> bytes:
    """``H(0x00 || data)``: the hash of one leaf (32 bytes)."""
    return _h(_LEAF + bytes(data))


def node_hash(left: bytes, right: bytes) -> bytes:
    """``H(0x01 || left || right)``: the hash of an inner node (32 bytes)."""
    return _h(_NODE + left + right)


def _split(n: int) -> int:
    """The largest power of two strictly below ``n`` (``n >= 2``): RFC 6962's k."""
    return 1 << ((n - 1).bit_length() - 1)


def root_of(hashes: list[bytes]) -> bytes:
    """The root over leaf hashes (from :func:`leaf_hash`), in order.

    Args:
        hashes: leaf hashes, 32 bytes each; may be empty.
    Returns:
        The 32-byte root (``H(b"")`` for no leaves, the leaf hash itself for one).
    Raises:
        ValueError: a hash is not 32 bytes.
    """
    for h in hashes:
        if not isinstance(h, (bytes, bytearray)) or len(h) != HASH_BYTES:
            raise ValueError(f"a leaf hash must be {HASH_BYTES} bytes")
    if not hashes:
        return _h(b"")
    return _root(list(hashes))


def _root(hashes: list[bytes]) -> bytes:
    if len(hashes) == 1:
        return bytes(hashes[0])
    k = _split(len(hashes))
    return node_hash(_root(hashes[:k]), _root(hashes[k:]))


def root(leaves: list[bytes]) -> bytes:
    """The root over leaf data (each hashed with :func:`leaf_hash`), in order."""
    return root_of([leaf_hash(d) for d in leaves])


def path(hashes: list[bytes], index: int) -> list[bytes]:
    """The inclusion path of leaf ``index``: sibling hashes from the leaf's level up to the root's.

    Args:
        hashes: every leaf hash of the tree, in order.
        index: the leaf, ``0 <= index < len(hashes)``.
    Returns:
        The sibling hashes, bottom up (empty for a tree of one leaf).
    Raises:
        IndexError: ``index`` is outside the tree.
    """
    if not 0 <= index < len(hashes):
        raise IndexError(f"leaf {index} is outside a tree of {len(hashes)} leaves")
    out: list[bytes] = []
    lo, hi = 0, len(hashes)
    stack = []
    while hi - lo > 1:  # top down, then reversed: each level's sibling subtree root
        k = _split(hi - lo)
        if index < lo + k:
            stack.append(_root(hashes[lo + k:hi]))
            hi = lo + k
        else:
            stack.append(_root(hashes[lo:lo + k]))
            lo = lo + k
    out.extend(reversed(stack))
    return out


def verify(leaf: bytes, index: int, size: int, siblings: list[bytes], expected_root: bytes) -> bool:
    """Whether ``leaf`` (the leaf hash) sits at ``index`` of a tree of ``size`` leaves with root
    ``expected_root``, by the path ``siblings`` (from :func:`path`). Fails closed: a malformed
    argument (wrong lengths, index outside the tree, too many or too few siblings) is False.
    """
    try:
        if not (isinstance(index, int) and isinstance(size, int) and 0 <= index < size):
            return False
        if len(leaf) != HASH_BYTES or len(expected_root) != HASH_BYTES:
            return False
        if any(not isinstance(s, (bytes, bytearray)) or len(s) != HASH_BYTES for s in siblings):
            return False
        # the same descent as path(): which side each sibling sits on, top down
        sides = []
        lo, hi = 0, size
        while hi - lo > 1:
            k = _split(hi - lo)
            if index < lo + k:
                sides.append("right")  # the sibling is the right subtree
                hi = lo + k
            else:
                sides.append("left")
                lo = lo + k
        if len(sides) != len(siblings):
            return False
        h = bytes(leaf)
        for side, sib in zip(reversed(sides), siblings):
            h = node_hash(h, bytes(sib)) if side == "right" else node_hash(bytes(sib), h)
        return h == bytes(expected_root)
    except (TypeError, ValueError):
        return False


class Tree:
    """A built tree: every leaf hash kept, so each path is cheap to produce again.

    Args:
        hashes: the leaf hashes in order (:func:`leaf_hash` of each leaf's data).
    """

    def __init__(self, hashes: list[bytes]) -> None:
        self.hashes = [bytes(h) for h in hashes]
        self.root = root_of(self.hashes)

    def __len__(self) -> int:
        return len(self.hashes)

    def path(self, index: int) -> list[bytes]:
        """:func:`path` of leaf ``index``. Raises IndexError outside the tree."""
        return path(self.hashes, index)
