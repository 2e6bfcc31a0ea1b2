"""swarm.merkle: RFC 6962 trees (BLAKE2b-256), roots, inclusion paths and their check."""

import hashlib

import pytest

from swarm import merkle


def H(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def leaves(n: int) -> list[bytes]:
    return [f"window {i}".encode() * (i + 1) for i in range(n)]


def test_small_trees_have_rfc6962_shape():
    l0, l1, l2, l3, l4 = (merkle.leaf_hash(d) for d in leaves(5))
    assert l0 == H(b"\x00" + leaves(1)[0])
    assert merkle.root([]) == H(b"")
    assert merkle.root(leaves(1)) == l0
    assert merkle.root(leaves(2)) == H(b"\x01" + l0 + l1)
    # three leaves: split at 2, the odd leaf is not duplicated
    assert merkle.root(leaves(3)) == H(b"\x01" + H(b"\x01" + l0 + l1) + l2)
    n01, n23 = H(b"\x01" + l0 + l1), H(b"\x01" + l2 + l3)
    assert merkle.root(leaves(5)) == H(b"\x01" + H(b"\x01" + n01 + n23) + l4)


def test_duplicating_the_last_leaf_changes_the_root():
    assert merkle.root(leaves(3)) != merkle.root(leaves(3) + leaves(3)[-1:])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33])
def test_every_path_verifies(n):
    hashes = [merkle.leaf_hash(d) for d in leaves(n)]
    tree = merkle.Tree(hashes)
    assert tree.root == merkle.root(leaves(n))
    for i in range(n):
        p = tree.path(i)
        assert len(p) <= (n - 1).bit_length()
        assert merkle.verify(hashes[i], i, n, p, tree.root)
        # the wrong index, another leaf, a shortened path: all refused (the leaf count is bound by the
        # receipt; a size giving the same shape may verify, which is why it travels signed)
        assert not merkle.verify(hashes[i], (i + 1) % n, n, p, tree.root) or n == 1
        assert not merkle.verify(merkle.leaf_hash(b"other"), i, n, p, tree.root)
        if p:
            assert not merkle.verify(hashes[i], i, n, p[:-1], tree.root)


@pytest.mark.parametrize("n", [3, 6])
def test_tampering_with_any_byte_fails(n):
    data = leaves(n)
    hashes = [merkle.leaf_hash(d) for d in data]
    tree = merkle.Tree(hashes)
    i = n - 1
    p = tree.path(i)
    for k in range(len(data[i])):
        bad = bytearray(data[i])
        bad[k] ^= 1
        assert not merkle.verify(merkle.leaf_hash(bytes(bad)), i, n, p, tree.root)
    for j in range(len(p)):
        for k in range(32):
            bad_path = [bytearray(x) for x in p]
            bad_path[j][k] ^= 0x80
            assert not merkle.verify(hashes[i], i, n, [bytes(x) for x in bad_path], tree.root)
    for k in range(32):
        bad_root = bytearray(tree.root)
        bad_root[k] ^= 1
        assert not merkle.verify(hashes[i], i, n, p, bytes(bad_root))


def test_a_node_never_passes_for_a_leaf():
    """Second preimage: the two children of the root, presented as one leaf of a tree of 1, do not verify."""
    hashes = [merkle.leaf_hash(d) for d in leaves(2)]
    root = merkle.root_of(hashes)
    forged_leaf = merkle.leaf_hash(hashes[0] + hashes[1])
    assert not merkle.verify(forged_leaf, 0, 1, [], root)


@pytest.mark.parametrize("args", [
    (b"x" * 31, 0, 1, [], b"r" * 32),  # short leaf hash
    (b"x" * 32, -1, 1, [], b"r" * 32),
    (b"x" * 32, 1, 1, [], b"r" * 32),  # index outside the tree
    (b"x" * 32, 0, 2, ["not bytes"], b"r" * 32),
    (b"x" * 32, 0, 0, [], b"r" * 32),
    (None, 0, 1, [], b"r" * 32),
])
def test_malformed_arguments_fail_closed(args):
    assert merkle.verify(*args) is False


def test_bad_input_raises_clearly():
    with pytest.raises(IndexError, match="outside a tree of 2"):
        merkle.path([merkle.leaf_hash(b"a")] * 2, 2)
    with pytest.raises(ValueError, match="32 bytes"):
        merkle.root_of([b"short"])
