"""Node identity: the ed25519 key file, the PeerId derived from it, and raw signatures.

Owns: reading/creating the key file (mode 0600), PeerId derivation, signing bytes with the node
key and verifying a signature from a PeerId alone (ed25519 PeerIds inline the public key).
May import: stdlib, libp2p (crypto, peer id), pynacl. No torch, no model terms.

The same key is the libp2p host identity and the receipt signing key, so the identity that
routes traffic is the identity that answers for it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

import nacl.exceptions
import nacl.signing
from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from swarm.errors import IdentityError

log = logging.getLogger(__name__)

SIGNATURE_BYTES = 64
_PUBKEY_BYTES = 32


def load_or_create_key(path: str | os.PathLike[str], create: bool = True) -> KeyPair:
    """Load the node's ed25519 key, creating it on first use.

    File format: the libp2p protobuf ``PrivateKey`` message (``Type = Ed25519``, ``Data`` = the
    32-byte ed25519 seed), exactly what ``libp2p.identity_utils.save_identity`` writes, so
    ``libp2p.identity_utils.load_identity`` reads our files and vice versa. A new file is
    created with ``os.open(..., 0o600)`` under a temporary name and hard-linked into place, so
    it never exists with looser permissions and never clobbers a concurrently created key.

    Args:
        path: key file location; parent directories are created when creating.
        create: create a new key when the file is absent (False: absence is an error).
    Returns:
        The libp2p ed25519 ``KeyPair``; its PeerId is stable across loads.
    Raises:
        IdentityError: the file is absent and ``create`` is False, is not a regular file, has
            group/other permission bits set (mode & 0o077), is unreadable, or is malformed
            (not a libp2p protobuf ed25519 private key).
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        if not create:
            raise IdentityError(f"key file {path} does not exist") from None
        return _create_key_file(path)
    except OSError as e:
        raise IdentityError(f"key file {path} cannot be read: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        raise IdentityError(f"key file {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise IdentityError(
            f"key file {path} has unsafe mode {mode:04o}: group/other may access it; "
            f"run `chmod 600 {path}`"
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise IdentityError(f"key file {path} cannot be read: {e.strerror}") from e
    key_pair = _parse_key(path, data)
    log.debug("identity.load path=%s peer=%s", path, peer_id_of(key_pair))
    return key_pair


def _parse_key(path: Path, data: bytes) -> KeyPair:
    """Decode key-file bytes into an ed25519 KeyPair, or raise IdentityError naming the path."""
    try:
        private_key = deserialize_private_key(data)
    except Exception as e:  # protobuf/nacl raise a zoo of types on garbage input
        raise IdentityError(
            f"key file {path} is malformed ({len(data)} bytes, not a libp2p protobuf "
            f"private key): {e}"
        ) from e
    if private_key.get_type() != KeyType.Ed25519 or not isinstance(
        private_key, Ed25519PrivateKey
    ):
        raise IdentityError(
            f"key file {path} holds a {private_key.get_type().name} key; swarm needs ed25519"
        )
    return KeyPair(private_key, private_key.get_public_key())


def _create_key_file(path: Path) -> KeyPair:
    """Write a fresh ed25519 key to ``path`` with mode 0600 (no-clobber) and return it."""
    key_pair = create_new_key_pair()
    data = key_pair.private_key.serialize()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and fails if another process created the key meanwhile
            raced = False
        except FileExistsError:
            raced = True
        finally:
            tmp.unlink()
    except OSError as e:
        raise IdentityError(f"key file {path} cannot be created: {e.strerror}") from e
    if raced:
        log.info("identity.create_race path=%s: loading the key another process wrote", path)
        return load_or_create_key(path, create=False)
    log.info("identity.create path=%s peer=%s", path, peer_id_of(key_pair))
    return key_pair


def peer_id_of(key_pair: KeyPair) -> str:
    """Return the base58 PeerId string of a key pair.

    Args:
        key_pair: a libp2p KeyPair (ed25519 for swarm nodes).
    Returns:
        The PeerId, e.g. ``12D3KooW...`` for ed25519 keys (identity multihash).
    """
    return ID.from_pubkey(key_pair.public_key).to_base58()


def sign(key_pair: KeyPair, data: bytes) -> bytes:
    """Sign ``data`` with the node key.

    Args:
        key_pair: the node's ed25519 KeyPair.
        data: the exact bytes to sign (callers canonicalize first).
    Returns:
        The raw 64-byte ed25519 signature (RFC 8032), verifiable with PyNaCl.
    Raises:
        IdentityError: the key is not ed25519.
    """
    if key_pair.private_key.get_type() != KeyType.Ed25519:
        raise IdentityError(f"sign needs an ed25519 key, got {key_pair.private_key.get_type().name}")
    return key_pair.private_key.sign(data)


def public_key_of_peer(peer_id: str) -> bytes:
    """Extract the raw 32-byte ed25519 public key inlined in a PeerId.

    Args:
        peer_id: base58 PeerId string.
    Returns:
        The 32 public key bytes.
    Raises:
        IdentityError: the string is not a PeerId, or the PeerId does not inline an ed25519
            key (e.g. an RSA PeerId, which is a sha2-256 hash of the key).
    """
    try:
        pid = ID.from_base58(peer_id)
    except Exception as e:  # base58 raises ValueError; be total on arbitrary input
        raise IdentityError(f"not a base58 PeerId: {peer_id!r}") from e
    public_key = pid.extract_public_key()
    if public_key is None or public_key.get_type() != KeyType.Ed25519:
        raise IdentityError(f"PeerId {peer_id} does not inline an ed25519 public key")
    raw = public_key.to_bytes()
    if len(raw) != _PUBKEY_BYTES:
        raise IdentityError(f"PeerId {peer_id} inlines a {len(raw)}-byte key, expected 32")
    return raw


def verify_peer_signature(peer_id: str, data: bytes, sig: bytes) -> bool:
    """Check that ``sig`` is the signature of ``data`` by the key behind ``peer_id``.

    Uses only the PeerId (its identity multihash carries the ed25519 public key) and PyNaCl,
    so a receipt can be verified with no network and no key registry.

    Args:
        peer_id: base58 PeerId of the claimed signer.
        data: the signed bytes.
        sig: raw 64-byte ed25519 signature.
    Returns:
        True only if the signature verifies; False for a bad signature, wrong length, or a
        PeerId that is malformed or not ed25519 (verification fails closed).
    """
    if len(sig) != SIGNATURE_BYTES:
        return False
    try:
        raw = public_key_of_peer(peer_id)
        nacl.signing.VerifyKey(raw).verify(data, sig)
    except (IdentityError, nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError):
        return False
    return True
