"""swarm.files.write_atomic: the whole new file or the old one, exact modes, no clobber on demand,
no temporary file left behind."""

from __future__ import annotations

import os
import stat

import pytest

from swarm.files import write_atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask():
    """Set the process umask for one test, restored afterwards."""
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


def test_writes_text_and_bytes_creating_the_directory(tmp_path):
    target = tmp_path / "a" / "b" / "doc.json"
    write_atomic(target, '{"x": "é"}')
    assert target.read_bytes() == '{"x": "é"}'.encode()
    write_atomic(target, b"\x00\xffraw")
    assert target.read_bytes() == b"\x00\xffraw"
    assert os.listdir(target.parent) == ["doc.json"]


@pytest.mark.parametrize("mask, mode, want", [
    (0o022, None, 0o644),   # as open(path, "w") makes it
    (0o077, None, 0o600),
    (0o022, 0o600, 0o600),  # a secret
    (0o077, 0o644, 0o644),  # exact whatever the umask
    (0o022, 0o640, 0o640),
])
def test_the_new_file_has_the_mode_asked_for(tmp_path, umask, mask, mode, want):
    umask(mask)
    target = tmp_path / "f"
    write_atomic(target, "x", mode=mode)
    assert _mode(target) == want


def test_replaces_an_existing_file_and_takes_the_new_mode(tmp_path):
    target = tmp_path / "f"
    target.write_text("old")
    os.chmod(target, 0o666)
    write_atomic(target, "new", mode=0o600)
    assert target.read_text() == "new" and _mode(target) == 0o600


def test_exclusive_never_clobbers(tmp_path):
    target = tmp_path / "key"
    write_atomic(target, b"first", mode=0o600, exclusive=True)
    assert target.read_bytes() == b"first" and _mode(target) == 0o600
    with pytest.raises(FileExistsError):
        write_atomic(target, b"second", mode=0o600, exclusive=True)
    assert target.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["key"]


def test_fsync_flushes_before_the_rename(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    write_atomic(tmp_path / "a", "x")
    assert synced == []
    write_atomic(tmp_path / "b", "x", fsync=True)
    assert len(synced) == 1


def test_a_failed_rename_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "f"
    target.write_text("old")

    def broken(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, "new")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["f"]


def test_a_failed_write_leaves_no_temp(tmp_path):
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "f", 12345)  # neither str nor bytes
    assert os.listdir(tmp_path) == []


def test_an_unwritable_directory_raises_oserror(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):
        write_atomic(blocker / "sub" / "f", "x")  # a file stands where the directory should be
