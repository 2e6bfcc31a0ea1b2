"""Key file handling, PeerId stability, and signatures verified from the PeerId alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import nacl.signing
import pytest
from libp2p.identity_utils import load_identity

from swarm.errors import IdentityError
from swarm.transport import load_or_create_key, peer_id_of, public_key_of_peer, sign, verify_peer_signature
from tests.support.transport import hold_key


def test_created_0600_in_new_dirs_and_peer_id_stable(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "node.key"
    old_umask = os.umask(0)  # even a permissive umask must not loosen the key file
    try:
        kp = load_or_create_key(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert peer_id_of(load_or_create_key(path)) == peer_id_of(kp)
    assert peer_id_of(load_or_create_key(path, create=False)) == peer_id_of(kp)
    assert peer_id_of(load_identity(path)) == peer_id_of(kp)  # libp2p's own format
    assert peer_id_of(kp).startswith("12D3KooW")
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temp file left


def test_missing_without_create_is_refused(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="does not exist"):
        load_or_create_key(tmp_path / "nope.key", create=False)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_group_or_other_access_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "node.key"
    load_or_create_key(path)
    path.chmod(mode)
    with pytest.raises(IdentityError) as info:
        load_or_create_key(path)
    assert str(path) in str(info.value) and f"{mode:04o}" in str(info.value)


@pytest.mark.parametrize("content", [b"", b"not a key", bytes(range(32)), b"\x08\x01\x12\x03abc"])
def test_malformed_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "node.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(IdentityError, match="node.key"):
        load_or_create_key(path)


def test_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dir.key").mkdir(mode=0o700)
    with pytest.raises(IdentityError, match="not a regular file"):
        load_or_create_key(tmp_path / "dir.key")


def test_sign_verify_from_peer_id_alone(tmp_path: Path) -> None:
    kp = load_or_create_key(tmp_path / "node.key")
    pid = peer_id_of(kp)
    data = b"receipt: job=1 range=[0, 5)"
    sig = sign(kp, data)
    assert len(sig) == 64
    assert verify_peer_signature(pid, data, sig)
    # PyNaCl alone, from the key bytes inlined in the PeerId:
    nacl.signing.VerifyKey(public_key_of_peer(pid)).verify(data, sig)

    assert not verify_peer_signature(pid, data + b"!", sig)
    assert not verify_peer_signature(pid, data, bytes([sig[0] ^ 1]) + sig[1:])
    assert not verify_peer_signature(pid, data, sig[:63])
    other = peer_id_of(load_or_create_key(tmp_path / "other.key"))
    assert not verify_peer_signature(other, data, sig)
    assert not verify_peer_signature("not-a-peer-id", data, sig)
    assert not verify_peer_signature("", data, sig)
    # A sha256 (non-inlined) PeerId carries no key: fails closed.
    assert not verify_peer_signature("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", data, sig)


@pytest.mark.process
def test_a_key_is_held_by_one_process(tmp_path: Path) -> None:
    from swarm.transport.identity import KeyInUse, claim_key, key_holder, release_keys

    path = tmp_path / "keys" / "stage-0-2.key"
    holder = hold_key(path)
    try:
        assert key_holder(path).startswith(str(holder.pid))
        with pytest.raises(KeyInUse) as info:  # an explicit or identity-bearing key: refused, naming the holder
            claim_key(path)
        assert f"in use by pid {holder.pid}" in str(info.value) and "--key" in str(info.value)
        kp, used = claim_key(path, fallback=True)  # a default nobody relies on: the next free slot
        assert used == tmp_path / "keys" / "stage-0-2-2.key"
        assert peer_id_of(kp) != peer_id_of(load_or_create_key(path))
        assert claim_key(path, fallback=True)[1] == used  # this process holds that slot already
    finally:
        release_keys()
        holder.kill()
        holder.wait()
    # the holder is gone (killed, not exiting cleanly): its lock went with it
    assert key_holder(path) is None
    assert claim_key(path)[1] == path
    release_keys()


def test_an_unwritable_key_directory_names_swarm_cache(tmp_path: Path) -> None:
    from swarm.errors import CacheUnwritable
    from swarm.transport.identity import claim_key, release_keys

    if os.geteuid() == 0:
        pytest.skip("root writes anywhere; tests/cli/test_cli_env.py covers this with CAP_DAC_OVERRIDE dropped")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(CacheUnwritable, match="SWARM_CACHE"):
            claim_key(ro / "keys" / "client.key")
    finally:
        release_keys()
        ro.chmod(0o755)



@pytest.mark.parametrize("where", ["proc", "under-a-file", "file-as-directory"])
def test_checking_a_key_that_cannot_be_created_says_what_claiming_it_says(tmp_path: Path, where: str) -> None:
    """``check_key_creatable`` (``swarm stage --check``) refuses where ``claim_key`` would, creating nothing:
    ``os.access`` says yes to root in ``/proc``, where no file can be created."""
    from swarm.transport.identity import check_key_creatable, claim_key, release_keys

    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")
    (tmp_path / "file").write_text("not a directory")
    path = {"proc": Path("/proc/swarm-nope.key"), "under-a-file": tmp_path / "file" / "d" / "k.key",
            "file-as-directory": tmp_path / "file" / "k.key"}[where]
    with pytest.raises(IdentityError) as checked:
        check_key_creatable(path)
    assert f"key file {path} cannot be created or locked in {path.parent}: " in str(checked.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and not path.exists()
    try:
        with pytest.raises(IdentityError) as claimed:
            claim_key(path)
    finally:
        release_keys()
    if where != "file-as-directory":  # there the start's mkdir says "File exists", the check "Not a directory"
        assert str(claimed.value) == str(checked.value)


def test_checking_a_key_that_can_be_created_creates_nothing(tmp_path: Path) -> None:
    from swarm.transport.identity import check_key_creatable

    check_key_creatable(tmp_path / "keys" / "s.key")
    check_key_creatable(tmp_path / "s.key")
    assert list(tmp_path.iterdir()) == []
