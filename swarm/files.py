"""Writing files so that a reader, or a crash, never sees half of one.

Owns: :func:`write_atomic`, the one way swarm writes a small file that others read (a weights
sidecar, a cached model id, a receipt, a conversation, a node key, a cached kernel proof).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes, *, mode: int | None = None, exclusive: bool = False,
                 fsync: bool = False) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part.

    The bytes go to a temporary file beside ``path`` (``.<name>.<random hex>.part``: hidden, and
    matched by no ``*.json`` or ``*.safetensors`` glob), which is then renamed over ``path`` (one
    atomic step on the same filesystem). A crash leaves at most a stray ``.part`` file.

    Args:
        path: the file to write; its directory is created if missing.
        data: the contents; ``str`` is written as UTF-8.
        mode: the new file's permission bits (e.g. ``0o600`` for a secret), set exactly whatever the
            umask; None: ``0o666`` less the umask, as ``open(path, "w")`` would create it.
        exclusive: never replace an existing ``path`` (no-clobber): the file is hard-linked into place,
            which fails if another process created ``path`` meanwhile.
        fsync: flush the bytes to disk before they take ``path``'s name (a key must survive a power cut).
    Raises:
        FileExistsError: ``exclusive`` and ``path`` exists.
        OSError: the directory or the file cannot be created or written; the temporary file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        try:
            view = memoryview(data.encode() if isinstance(data, str) else data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if mode is not None:
            os.chmod(tmp, mode)  # the umask may have taken bits the caller asked for
        if exclusive:
            os.link(tmp, path)  # unlike a rename, fails when path exists
        else:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # gone already after a rename; a leftover after a link or a failure
