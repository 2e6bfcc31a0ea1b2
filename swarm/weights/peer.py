"""The weights protocol ``/swarm/weights/1.0.0``: stages serve their weights files to joining stages.

Owns: ``WeightsServer`` (every stage's manifest and files), ``serve_weights`` (registered on a host) and
``fetch_weights`` (a layer range's files from peers in order, every tensor checked as it arrives, each file
renamed into place once verified, the next peer on a failure). No torch. Wire and trust: docs/protocol.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libp2p.security.noise.io as _noise_io
import libp2p.stream_muxer.yamux.yamux as _yamux
import trio
from libp2p.exceptions import BaseLibp2pError

from swarm.config import check_fetch_addr
from swarm.errors import (HopTimeout, ModelError, ProtocolError, SwarmError, StreamClosed,
                          WeightsMismatch)
from swarm.transport.framing import FramedStream, decode_body, decode_length_prefix, encode_frame
from swarm.weights.manifest import shard_files
from swarm.weights.identify import load_manifest
from swarm.weights.select import metadata_files, num_layers_of, select_shards
from swarm.weights.store import (FileVerifier, ShardVerifier, WeightsManifest, file_digest, install, layout_key,
                                 local_layout, parse_manifest, reverify, safe_file_name, sidecar_manifest, temp_file,
                                 weights_dir, write_sidecar)

log = logging.getLogger(__name__)

PROTOCOL_ID = "/swarm/weights/1.0.0"
REQUEST_MAX_BYTES = 64 * 1024  # a request frame: a manifest or get request is a few hundred bytes
REPLY_MAX_BYTES = 64 * 2**20  # a manifest reply: ~100 bytes per tensor of the model
# Bytes per write on the stream: one Yamux frame (12-byte header) that fills exactly one Noise message
# (65535 bytes less its 16-byte tag). Yamux cuts a larger write into 64 KiB frames, each of which Noise
# sends as two messages (65519 + 29 bytes): twice the encryptions, syscalls and reads on both sides.
# Measured on loopback, 200 MiB: sender 1.2-1.5 CPU-s and receiver 1.4-1.5 (this size) against
# 1.7-2.0 and 2.3-2.6 (1 MiB writes). Pinned to libp2p 0.8.1's constants (tests/weights/test_fetch.py).
WRITE_BYTES = _noise_io.MAX_PLAINTEXT_LENGTH - _yamux.HEADER_SIZE
SEND_BLOCK_BYTES = 16 * WRITE_BYTES  # bytes per read from disk (in a worker thread): ~1 MiB
RECV_BLOCK_BYTES = 4 * 2**20  # most bytes one read may return
# Each read returns what Yamux has buffered and sends a window update (another Noise message and
# syscall each way); reading as soon as each 64 KiB frame lands spends a third of the fetcher's CPU on
# that. After a read of less than 1 MiB the fetcher lets frames queue for 2 ms. Measured on loopback
# (SmolLM2, 209 MB): fetcher CPU 1.68-1.81 s -> 1.10-1.29 s, 114-142 MB/s -> 156-184 MB/s, same runs.
COALESCE_S = 0.002
COALESCE_BELOW_BYTES = 2**20
MAX_TRANSFERS = 2  # files a stage sends at once (more fetchers wait): its sessions keep the event loop
IDLE_TIMEOUT_S = 60.0  # a weights stream with no request for this long is closed
_RAW_ERRORS = (EOFError, OSError, BaseLibp2pError, trio.BrokenResourceError, trio.ClosedResourceError)


# ---- serving ---------------------------------------------------------------------------------------

class WeightsServer:
    """Serve the weights a stage holds: its manifest and whole files, one stream per fetcher.

    Args:
        model_dir: the stage's checkpoint directory (full, or a weights directory of some shards).
        model_name: the name the stage serves under (what a fetcher without ``--model-id`` checks).
        cache_dir: where ``manifest.load_manifest`` caches the hashes of a full directory.
        max_transfers: files sent at once; further ``get`` requests wait for a slot.
        timeout_s: deadline of each write to a fetcher (a stalled fetcher is dropped).
    """

    def __init__(self, model_dir: Path, model_name: str, cache_dir: Path | None = None, *,
                 max_transfers: int = MAX_TRANSFERS, timeout_s: float = 30.0,
                 idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.model_dir = Path(model_dir)
        self.model_name = model_name
        self.cache_dir = cache_dir
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._reply: dict | None = None
        self._served: set[str] = set()
        self._lock = trio.Lock()
        self._slots = trio.Semaphore(max_transfers)

    async def manifest_reply(self) -> dict:
        """The ``manifest`` reply (built once, hashing a full directory in a worker thread; cached on disk).

        Raises:
            ModelError: the directory cannot be read or hashed.
        """
        async with self._lock:
            if self._reply is None:
                try:
                    self._reply = await trio.to_thread.run_sync(self._build_reply)
                except (OSError, ValueError) as e:  # a directory that changed under the stage
                    raise ModelError(f"cannot list the weights in {self.model_dir}: {e}") from e
                self._served = set(self._reply["held"]) | set(self._reply["files"])
        return self._reply

    def _build_reply(self) -> dict:
        path = self.model_dir
        t0 = time.monotonic()
        mid, tensors = load_manifest(path, self.cache_dir)
        partial = sidecar_manifest(path)
        if partial is not None:
            layout, num_layers = partial.shards, partial.num_layers
        else:
            layout = local_layout(path, [f.name for f in shard_files(path)])
            num_layers = num_layers_of(json.loads((path / "config.json").read_text()))
        held = sorted(f for f in layout if (path / f).is_file())
        files = {f: file_digest(path / f) for f in metadata_files(os.listdir(path)) if (path / f).is_file()}
        log.info("weights.serve.ready dir=%s model_id=%s shards=%d/%d files=%d build_s=%.2f", path,
                 (mid or "unknown")[:16], len(held), len(layout), len(files), time.monotonic() - t0)
        return {"t": "manifest", "v": 1, "model": self.model_name, "model_id": mid, "num_layers": num_layers,
                "tensors": tensors, "shards": layout, "held": held, "files": files}

    async def handle(self, stream: FramedStream) -> None:
        """Answer one fetcher's requests until it closes the stream or stays idle.

        A malformed frame or request ends this stream only (logged); the stage and its sessions go on.
        """
        peer = stream.remote_peer_id
        try:
            while True:
                try:
                    msg = await stream.recv(timeout_s=self.idle_timeout_s)
                except HopTimeout:
                    log.info("weights.serve.idle peer=%s", peer)
                    return
                kind = msg.get("t")
                if kind == "manifest":
                    try:
                        reply = await self.manifest_reply()
                    except ModelError as e:
                        reply = {"t": "error", "reason": f"cannot list weights: {e}"}
                    await stream.send(reply, timeout_s=self.timeout_s)
                elif kind == "get":
                    await self._send_file(stream, msg.get("file"))
                else:
                    await stream.send({"t": "error", "reason": f"unknown request {kind!r}: expected 'manifest' or "
                                                               "'get'"}, timeout_s=self.timeout_s)
        except StreamClosed:
            return  # the fetcher is done (or gone)
        except ProtocolError as e:  # a malformed frame: the reader has reset the stream already
            log.warning("weights.serve.bad_frame peer=%s error=%s", peer, e)
        except HopTimeout as e:
            log.warning("weights.serve.stalled peer=%s error=%s", peer, e)

    async def _send_file(self, stream: FramedStream, file: object) -> None:
        if not self._served:
            with contextlib.suppress(ModelError):
                await self.manifest_reply()
        if not safe_file_name(file) or file not in self._served:
            await stream.send({"t": "error", "reason": f"not held here: {file!r}"}, timeout_s=self.timeout_s)
            return
        async with self._slots:
            try:
                f = (self.model_dir / file).open("rb")
            except OSError as e:
                await stream.send({"t": "error", "reason": f"cannot read {file}: {e.strerror}"},
                                  timeout_s=self.timeout_s)
                return
            with f:
                size = os.fstat(f.fileno()).st_size
                await stream.send({"t": "data", "file": file, "bytes": size}, timeout_s=self.timeout_s)
                t0, sent = time.monotonic(), 0
                try:
                    while sent < size:
                        block = await trio.to_thread.run_sync(f.read, min(SEND_BLOCK_BYTES, size - sent))
                        if not block:
                            raise OSError(f"{file} shrank while being sent")
                        for at in range(0, len(block), WRITE_BYTES):  # raw bytes after the data frame
                            with trio.fail_after(self.timeout_s):
                                await stream.raw.write(block[at:at + WRITE_BYTES])
                        sent += len(block)
                except trio.TooSlowError:
                    await stream.reset()
                    raise HopTimeout(f"sending {file} to {stream.remote_peer_id}: no progress in {self.timeout_s}s") \
                        from None
                except _RAW_ERRORS as e:
                    await stream.reset()  # the byte stream is cut mid-file: the fetcher sees a reset
                    raise StreamClosed(f"sending {file} to {stream.remote_peer_id} failed: {e!r}") from e
        log.info("weights.serve.sent peer=%s file=%s bytes=%d seconds=%.2f", stream.remote_peer_id, file, size,
                 time.monotonic() - t0)


def serve_weights(host, model_dir: Path | None, model_name: str, cache_dir: Path | None = None) -> WeightsServer | None:
    """Register a ``WeightsServer`` for ``model_dir`` on a ``SwarmHost`` (nothing if ``model_dir`` is None)."""
    if model_dir is None:
        return None
    server = WeightsServer(model_dir, model_name, cache_dir)
    host.set_handler(PROTOCOL_ID, server.handle, max_frame_bytes=REQUEST_MAX_BYTES)
    return server


# ---- fetching --------------------------------------------------------------------------------------

class _NotHeld(SwarmError):
    """The peer answered a get with an error (it does not hold the file); the stream stays usable."""


class _PeerStream:
    """One persistent weights stream to a peer: framed requests, framed replies, raw file bytes."""

    def __init__(self, raw, addr: str, timeout_s: float):
        self.raw, self.addr, self.timeout_s = raw, addr, timeout_s
        self.in_sync = True  # False once a file transfer was abandoned midway: only a reset is left

    async def request(self, msg: dict) -> dict:
        try:
            with trio.fail_after(self.timeout_s):
                await self.raw.write(encode_frame(msg, REQUEST_MAX_BYTES))
        except trio.TooSlowError:
            raise HopTimeout(f"sending a request to {self.addr} timed out after {self.timeout_s}s") from None
        except _RAW_ERRORS as e:
            raise StreamClosed(f"the weights stream to {self.addr} broke: {e!r}") from e
        length = decode_length_prefix(await self._read_exact(4), REPLY_MAX_BYTES)
        reply = decode_body(await self._read_exact(length))
        if reply.get("t") == "error":
            raise _NotHeld(str(reply.get("reason"))[:300])
        return reply

    async def read(self, n: int) -> bytes:
        try:
            with trio.fail_after(self.timeout_s):
                data = await self.raw.read(n)
        except trio.TooSlowError:
            raise HopTimeout(f"{self.addr} sent nothing for {self.timeout_s}s") from None
        except EOFError:
            data = b""
        except _RAW_ERRORS as e:
            raise StreamClosed(f"the weights stream from {self.addr} broke: {type(e).__name__}") from e
        if not data:
            raise StreamClosed(f"{self.addr} closed the weights stream")
        return data

    async def _read_exact(self, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            data = await self.read(n - got)
            parts.append(data)
            got += len(data)
        return b"".join(parts)

    async def close(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(*_RAW_ERRORS):
            await (self.raw.close() if self.in_sync else self.raw.reset())


@dataclass
class PeerFetch:
    """What ``fetch_weights`` got.

    Attributes:
        path: the weights directory, complete for the layer range; None if peers could not supply it.
        manifest: the accepted manifest (hashes to ``model_id``), also when files are missing, so a
            fallback source can be checked against it; None when no peer gave a valid one.
        missing: required files (config.json, shards) no peer delivered.
        failures: one line per peer problem, in order.
        fetched_bytes / seconds: bytes received into verified files, and the wall time of the fetch.
        model_id: the accepted manifest's model id.
    """

    path: Path | None = None
    manifest: WeightsManifest | None = None
    missing: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    fetched_bytes: int = 0
    seconds: float = 0.0
    model_id: str | None = None


async def fetch_weights(host, peers: Sequence[str], *, name: str, layers, root: Path,
                        expect_model_id: str | None = None, timeout_s: float = 30.0) -> PeerFetch:
    """Fetch the files a stage holding ``layers`` needs from peers, verified, into a weights directory.

    Peers are tried in order over one stream each. The first whose manifest is valid fixes the
    model id (unless ``expect_model_id`` is given) and the layout; then config.json (to name the
    needed shards), the tokenizer and config files, and the needed shards come from that peer, and
    whatever it cannot give (it lacks a file, a transfer breaks, or a tensor does not match) from the
    next peer. A shard is written to a temp file while its tensors are hashed, and renamed into the
    directory only when every tensor matched. Shards already in the directory are verified again
    and not fetched.

    Args:
        host: a running ``SwarmHost`` (dials out; its listen address does not matter).
        peers: multiaddrs with ``/p2p/<PeerId>`` of stages holding the model; never circuit addresses.
        name: the model name (``--model``); without ``expect_model_id`` a peer serving another
            name is skipped.
        layers: the stage's LayerRange; None: no shards, only the manifest, config.json and the
            small files (what a stage without ``--layers`` needs to pick its block first).
        root: where weights directories live (``<cache_root>/weights``).
        expect_model_id: the model id the weights must have (64 hex), or None.
        timeout_s: deadline of each network wait (dial, request, any read making no progress).
    Returns:
        a PeerFetch; ``path`` is set only when every required file arrived verified.
    Raises:
        ConfigError: a peer address is malformed or a circuit address (before anything is dialed).
    """
    for addr in peers:
        check_fetch_addr(addr)
    out = PeerFetch()
    t0 = time.monotonic()
    dest: Path | None = None
    want: list[str] | None = None  # files still needed; None until config.json is here
    optional: set[str] = set()
    files_doc: dict = {}
    for addr in peers:
        stream = None
        try:
            stream = _PeerStream(await host.open_raw_stream(addr, PROTOCOL_ID, timeout_s), addr, timeout_s)
            reply = await stream.request({"t": "manifest"})
            manifest, held, peer_files = _check_reply(reply, addr, name, expect_model_id or out.model_id)
            if out.manifest is None:
                out.manifest, out.model_id = manifest, manifest.model_id
                dest = weights_dir(root, name, layout_key(manifest, ""))
                dest.mkdir(parents=True, exist_ok=True)
                files_doc = dict(peer_files)  # the small files every later peer must match
                write_sidecar(dest, manifest, name=name, source={"kind": "peers", "peers": list(peers)},
                              files=files_doc)
            elif manifest.shards != out.manifest.shards:
                raise ProtocolError(f"{addr} holds the same weights in another shard layout")
            if want is None:
                if not _have_file(dest, "config.json", files_doc):
                    if "config.json" not in peer_files or "config.json" not in files_doc:
                        raise ProtocolError(f"{addr} does not serve config.json")
                    check = FileVerifier("config.json", *files_doc["config.json"])
                    await _fetch_one(stream, "config.json", dest, check, out)
                want, optional = _plan(dest, out.manifest, layers, files_doc)
            await _fetch_held(stream, want, held, peer_files, dest, files_doc, out)
            if not [f for f in want if f not in optional]:
                break
        except WeightsMismatch as e:
            log.warning("weights.fetch.tampered peer=%s error=%s", addr, e)
            out.failures.append(f"{addr}: {e}")
        except (SwarmError, OSError) as e:  # unreachable, timeouts, broken streams, bad manifests
            log.warning("weights.fetch.peer_failed peer=%s error=%s", addr, e)
            out.failures.append(f"{addr}: {e}")
        finally:
            if stream is not None:
                await stream.close()
    out.seconds = time.monotonic() - t0
    if want is None:
        out.missing = ["config.json"]
        return out
    _finish(out, dest, want, optional, name=name, peers=peers, files_doc=files_doc)
    return out


async def _fetch_held(stream: _PeerStream, want: list[str], held: list[str], peer_files: dict, dest: Path,
                      files_doc: dict, out: PeerFetch) -> None:
    """Fetch, verified, each file of ``want`` this peer holds (shards in ``held``, small files in
    ``peer_files``), removing it from ``want``; a file the peer turns out not to hold is recorded in
    ``out.failures`` and left for the next peer."""
    for file in list(want):
        if file not in peer_files and file not in held:
            continue  # this peer does not hold it: the next one may
        verifier = (ShardVerifier(file, out.manifest.shards[file], out.manifest.tensors)
                    if file in out.manifest.shards else FileVerifier(file, *files_doc[file]))
        try:
            await _fetch_one(stream, file, dest, verifier, out)
        except _NotHeld as e:
            out.failures.append(f"{stream.addr}: {file}: {e}")
            continue
        want.remove(file)


def _finish(out: PeerFetch, dest: Path, want: list[str], optional: set[str], *, name: str, peers: Sequence[str],
            files_doc: dict) -> None:
    """Record in ``out`` what is still missing after every peer was tried; when nothing required is,
    write the directory's sidecar and set ``out.path``."""
    out.missing = [f for f in want if f not in optional]
    if [f for f in want if f in optional]:
        log.warning("weights.fetch.optional_missing files=%s", [f for f in want if f in optional])
    if not out.missing:
        write_sidecar(dest, out.manifest, name=name, source={"kind": "peers", "peers": list(peers)}, files=files_doc)
        out.path = dest
        log.info("weights.fetch.done dir=%s model_id=%s bytes=%d seconds=%.2f mb_per_s=%.1f", dest,
                 out.model_id[:16], out.fetched_bytes, out.seconds, out.fetched_bytes / max(out.seconds, 1e-9) / 1e6)


def _check_reply(reply: dict, addr: str, name: str,
                 expect_model_id: str | None) -> tuple[WeightsManifest, list[str], dict]:
    """(manifest, shards held, small files) of a peer's reply, or a SwarmError saying why not to use it."""
    if reply.get("t") != "manifest" or reply.get("v") != 1:
        raise ProtocolError(f"{addr} answered {reply.get('t')!r} (version {reply.get('v')!r}), not a manifest v1")
    manifest = parse_manifest(reply, f"manifest from {addr}")
    if manifest.model_id is None:
        raise ModelError(f"{addr} does not know the model id of its weights (it holds only some shards, from the hub "
                         "without a manifest)")
    if expect_model_id is not None and manifest.model_id != expect_model_id:
        raise ModelError(f"{addr} serves model id {manifest.model_id[:16]}..., not {expect_model_id[:16]}...")
    peer_name = reply.get("model")
    if expect_model_id is None and (not isinstance(peer_name, str) or peer_name.lower() != name.lower()):
        raise ModelError(f"{addr} serves model {peer_name!r} (id {manifest.model_id}), not {name!r}: pass "
                         f"--model-id {manifest.model_id} to accept those weights")
    held, files = reply.get("held"), reply.get("files")
    if not isinstance(held, list) or not all(h in manifest.shards for h in held):
        raise ProtocolError(f"{addr}: 'held' must list shards of its layout")
    if not isinstance(files, dict) or not all(
            safe_file_name(f) and f in metadata_files([f]) and isinstance(v, list) and len(v) == 2
            and isinstance(v[0], int) and 0 <= v[0] <= REPLY_MAX_BYTES and isinstance(v[1], str)
            for f, v in files.items()):
        raise ProtocolError(f"{addr}: 'files' must map config/tokenizer file names to [size, sha256]")
    return manifest, held, files


def _plan(dest: Path, manifest: WeightsManifest, layers, files_doc: dict) -> tuple[list[str], set[str]]:
    """(files still to fetch, which of them are optional): small files not here yet, then the needed
    shards that are absent or fail verification (those are deleted)."""
    try:
        config = json.loads((dest / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read the fetched {dest / 'config.json'}: {e}") from e
    if num_layers_of(config) != manifest.num_layers:
        raise WeightsMismatch(f"config.json says {num_layers_of(config)} layers, the manifest {manifest.num_layers}")
    small = [f for f in sorted(files_doc) if f != "config.json" and not _have_file(dest, f, files_doc)]
    if layers is None:  # metadata only (a stage placing itself): config, tokenizer, the manifest
        return small, set(small)
    selection = select_shards(manifest.weight_map, config, layers)
    return small + reverify(dest, manifest, selection.shards), set(small)


def _have_file(dest: Path, file: str, files_doc: dict) -> bool:
    return (dest / file).is_file() and file in files_doc and file_digest(dest / file) == list(files_doc[file])


async def _fetch_one(stream: _PeerStream, file: str, dest: Path, verifier, out: PeerFetch) -> None:
    """Get one file over ``stream``: hash while reading, write a temp file, rename it once verified."""
    reply = await stream.request({"t": "get", "file": file})
    size = reply.get("bytes")
    if reply.get("t") != "data" or reply.get("file") != file or isinstance(size, bool) or not isinstance(size, int) \
            or not 0 <= size < 2**40:
        raise ProtocolError(f"{stream.addr} answered get {file!r} with {str(reply)[:120]}")
    sink, tmp = temp_file(dest, file)
    got = 0
    try:
        stream.in_sync = False
        with sink:
            while got < size:
                data = await stream.read(min(RECV_BLOCK_BYTES, size - got))
                verifier.feed(data)  # raises at the first tensor that does not match
                sink.write(data)
                got += len(data)
                if len(data) < COALESCE_BELOW_BYTES and got < size:
                    await trio.sleep(COALESCE_S)  # let more frames queue: fewer reads, fewer window updates
        stream.in_sync = True
        verifier.finish()
        install(tmp, dest / file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    out.fetched_bytes += size
    log.info("weights.fetch.file peer=%s file=%s bytes=%d", stream.addr, file, size)
