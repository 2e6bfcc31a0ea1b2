"""The swarm error hierarchy. Standard library only.

Every error carries the facts of the fault (peer, session, layer range, sizes) in its message so
that a one-line log or a FATAL line says exactly what went wrong.
"""

from __future__ import annotations

import errno


class SwarmError(Exception):
    """Base class of every error swarm raises on purpose. ``exit_code``: what a command exits with."""

    exit_code = 1


class ConfigError(SwarmError):
    """A command-line flag, config file or ring file is invalid."""


class CacheUnwritable(ConfigError):
    """swarm must write under its cache (keys, converted models, manifests, kernels, proofs) and cannot:
    the directory is read-only or not ours (a HOME that is not writable), or cannot be created at all
    (``create``: SWARM_CACHE under /proc, or where a file stands). Exit code 2."""

    exit_code = 2

    def __init__(self, path, why: str | None = None, also: str = "", *, create: bool = False) -> None:
        self.path = path
        because = f" ({why})" if why else ""
        what = f"create the cache directory {path}" if create else f"write {path}"
        super().__init__(f"cannot {what}{because}: set SWARM_CACHE to a writable directory (swarm keeps keys, "
                         f"converted models and built kernels there; default ~/.cache/swarm){also}")


class ListenError(ConfigError):
    """A command cannot listen where it was told to (the port is taken, the address is not local). Exit code 2."""

    exit_code = 2

    def __init__(self, where: str, exc: OSError | None = None, flag: str = "--port", why: str | None = None) -> None:
        self.where = where
        code = getattr(exc, "errno", None)
        if code == errno.EADDRINUSE:
            why, todo = "address already in use", f"pick another {flag}, or stop the process using it"
        elif code == errno.EADDRNOTAVAIL:
            why, todo = "not an address of this machine", "listen on one of its addresses, or 0.0.0.0 for all"
        elif code == errno.EACCES:
            why, todo = "permission denied", f"ports below 1024 need privileges: pick another {flag}"
        else:
            why, todo = why or (getattr(exc, "strerror", None) or str(exc)).lower(), f"check {flag}"
        super().__init__(f"cannot listen on {where}: {why} ({todo})")


class ModelError(SwarmError):
    """A model cannot be resolved, converted or loaded (missing file, unsupported family, offline hub)."""


class WeightsMismatch(ModelError):
    """Weights bytes do not match the manifest that names them (a tampered or corrupted tensor, a header
    that differs from the expected layout); nothing from that file is kept."""


class IdentityError(SwarmError):
    """A key file is missing, unreadable, malformed or has unsafe permissions."""


class ProtocolError(SwarmError):
    """A peer sent bytes that are not a valid swarm frame (bad length, msgpack, schema, dtype, shape)."""


class FrameTooLarge(ProtocolError):
    """A frame's declared length exceeds the maximum; raised before anything is allocated."""


class StreamClosed(SwarmError):
    """The peer closed the stream (EOF) or reset it; no more frames will arrive."""


class HopTimeout(SwarmError):
    """A network wait ran past its deadline (dial, read or write on a hop)."""


class StageLost(SwarmError):
    """A stage of the ring is unreachable or stopped answering."""


class ContextOverflow(SwarmError):
    """A session would grow past the maximum context length."""


class CacheFull(SwarmError):
    """The KV cache budget cannot admit another session."""


class RemoteError(SwarmError):
    """A stage answered a request with an error frame; the message is the stage's reason."""


class ReceiptInvalid(SwarmError):
    """A receipt failed verification (signature, tiling, digest chain, nonce, token digest)."""


class AuditFailed(SwarmError):
    """A stage's opening of a window did not check (``.check``: receipt, schema, mismatch, signature,
    path) or the stage refused it (``refused``, with the stage's error ``.code``)."""

    check = ""
    code = None


class ProofRefused(SwarmError):
    """A fraud proof did not hold (``swarm.proofs``): ``.reason`` (malformed, signature, opening, wrong
    window, input not bound, another class, honest stage framed, not comparable) and ``.against``: the
    auditor whose signed claim is then evidence against it (a framing), else None."""

    reason = ""
    against = None


def collapse(exc: BaseException) -> BaseException:
    """The first SwarmError (or KeyboardInterrupt) inside nested exception groups, else ``exc``.

    trio nurseries wrap errors in ExceptionGroups; a command reports the one fault that matters.
    """
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = collapse(sub)
            if isinstance(found, (SwarmError, KeyboardInterrupt)):
                return found
    return exc
