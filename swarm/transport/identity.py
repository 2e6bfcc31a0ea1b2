"""Node identity: the ed25519 key file, the PeerId derived from it, and raw signatures.

Owns: reading and creating the key file (mode 0600), ``claim_key`` (one process per key), the PeerId, ``sign``
with the node key and ``verify_peer_signature`` from a PeerId alone. The same key is the libp2p identity and
the receipt key (docs/architecture.md, "Identity").
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import sys
import tempfile
from pathlib import Path

import nacl.exceptions
import nacl.signing
from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from swarm.errors import CacheUnwritable, IdentityError
from swarm.files import write_atomic

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
        try:
            # exclusive: fails if another process created the key meanwhile
            write_atomic(path, data, mode=0o600, exclusive=True, fsync=True)
            raced = False
        except FileExistsError:
            if not path.parent.is_dir():  # a file stands where the key's directory should be
                raise
            raced = True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise CacheUnwritable(e.filename or path.parent, e.strerror, KEY_HINT) from None
        raise IdentityError(f"key file {path} cannot be created: {e.strerror}") from e
    if raced:
        log.info("identity.create_race path=%s: loading the key another process wrote", path)
        return load_or_create_key(path, create=False)
    log.info("identity.create path=%s peer=%s", path, peer_id_of(key_pair))
    return key_pair


class KeyInUse(IdentityError):
    """Another running process holds this key file (two processes with one PeerId knock each other out:
    the DHT keeps one record per PeerId, a stage cannot tell their sessions' owners apart)."""

    def __init__(self, path: Path, holder: str | None) -> None:
        self.path, self.holder = path, holder
        who = f"pid {holder}" if holder else "another process"
        super().__init__(f"key file {path} is in use by {who}: one key is one node; stop that process, or give "
                         f"this one its own key with --key FILE")


KEY_HINT = ", or pass --key FILE in a writable directory"
FALLBACK_SLOTS = 64  # coordinator.key, coordinator-2.key, ... coordinator-64.key
_REFUSED = (errno.EACCES, errno.EROFS, errno.EPERM)  # writing there is not allowed (CacheUnwritable)
_HELD: dict[Path, int] = {}  # key files this process holds: resolved path -> fd of the flock'ed lock file


def lock_path_of(path: str | os.PathLike[str]) -> Path:
    """The lock file beside a key file: ``<key>.lock`` (holds the holder's pid and command line)."""
    path = Path(path)
    return path.with_name(path.name + ".lock")


def claim_key(path: str | os.PathLike[str], *, fallback: bool = False) -> tuple[KeyPair, Path]:
    """Load (or create) a node key and hold it for the life of this process.

    The hold is an exclusive ``flock`` on ``<key>.lock`` beside it (the holder's pid and command line
    written inside), kept until the process exits or ``release_keys``: the kernel drops it with the
    process, so a crashed or killed holder never blocks the next start. Claiming a key this process
    already holds succeeds. Where the directory is read-only the key file itself is locked.

    Args:
        path: the key file (created 0600 if absent, as ``load_or_create_key``).
        fallback: the path is a default whose identity does not matter to the user (a client's key, a
            stage that picks its own block): when another process holds it, use the first free of
            ``<stem>-2<suffix>``, ``<stem>-3<suffix>``, ... instead (each kept, so a slot's PeerId is
            stable too), and log which.
    Returns:
        (the key pair, the key file actually used).
    Raises:
        KeyInUse: another running process holds ``path`` (and ``fallback`` is False, or every slot is held).
        CacheUnwritable: the key does not exist and its directory cannot be written.
        IdentityError: as ``load_or_create_key``.
    """
    path = Path(path)
    candidates = [path] + ([path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(2, FALLBACK_SLOTS + 1)]
                           if fallback else [])
    first_holder: KeyInUse | None = None
    for candidate in candidates:
        try:
            _lock(candidate)
        except KeyInUse as exc:
            first_holder = first_holder or exc
            continue
        try:
            key_pair = load_or_create_key(candidate)
        except BaseException:
            _unlock(candidate)
            raise
        if candidate != path:
            log.warning("identity.in_use key=%s holder=pid %s: this process uses %s (PeerId %s); give it --key "
                        "FILE to choose", path, first_holder.holder if first_holder else "?", candidate,
                        peer_id_of(key_pair))
        return key_pair, candidate
    assert first_holder is not None  # every candidate was held
    raise first_holder


def key_holder(path: str | os.PathLike[str]) -> str | None:
    """The pid (as text) of the running process holding ``path``, else None. Takes no lock.

    Args:
        path: a key file. Returns: the holder's pid from its lock file, "?" if it wrote none.
    """
    path = Path(path)
    if path.resolve() in _HELD:
        return str(os.getpid())
    lock = lock_path_of(path)
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd) or "?"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def release_keys() -> None:
    """Let go of every key this process holds (its exit does the same)."""
    for path in list(_HELD):
        _unlock(path)


def _lock(path: Path) -> None:
    """flock ``path``'s lock file for this process, or raise KeyInUse naming the holder."""
    resolved = path.resolve()
    if resolved in _HELD:
        return
    lock = lock_path_of(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        if exc.errno not in _REFUSED or not path.exists():
            raise _cannot_create(path, exc.filename or path.parent, exc) from exc
        fd = os.open(path, os.O_RDONLY)  # a read-only directory with the key in it: lock the key itself
        lock = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd) if lock is not None else None
        os.close(fd)
        raise KeyInUse(path, holder) from None
    if lock is not None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {' '.join(sys.argv)[:300]}\n".encode(errors="replace"), 0)
    _HELD[resolved] = fd


def check_key_creatable(path: str | os.PathLike[str]) -> None:
    """Raise what ``claim_key`` would raise creating the absent key file ``path`` and its lock, creating
    neither (``swarm stage --check``).

    A file is created and removed in the nearest existing directory above ``path``: ``os.access`` says yes
    to root where the filesystem still refuses (``/proc``), so only a real create tells.

    Raises:
        CacheUnwritable: writing there is refused (permissions, a read-only filesystem).
        IdentityError: no file can be created there for another reason (not a directory, ``/proc``).
    """
    path = Path(path)
    where = path.parent
    while not where.exists() and where.parent != where:
        where = where.parent
    try:
        if not where.is_dir():  # a file stands where the key's directory should be
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(where))
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=where)
    except OSError as exc:
        raise _cannot_create(path, where, exc) from exc
    os.close(fd)
    os.unlink(probe)


def _cannot_create(path: Path, where: str | os.PathLike[str], exc: OSError) -> CacheUnwritable | IdentityError:
    """The one-line error for a key file (or its lock) that cannot be created: ``where`` refused ``exc``."""
    if exc.errno in _REFUSED:
        return CacheUnwritable(where, exc.strerror, KEY_HINT)
    return IdentityError(f"key file {path} cannot be created or locked in {path.parent}: {exc.strerror}; pass "
                         "--key FILE in a writable directory")


def _unlock(path: Path) -> None:
    fd = _HELD.pop(Path(path).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor drops the flock


def _read_holder(fd: int) -> str | None:
    try:
        text = os.pread(fd, 400, 0).decode(errors="replace").strip()
    except OSError:
        return None
    pid, _, command = text.partition(" ")
    if not pid.isdigit():
        return None
    return f"{pid} ({command})" if command else pid


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
