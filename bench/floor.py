"""What a ring of processes can reach on this machine without any of swarm's transport: the floor
under ``bench/ring_overhead.py``'s ratio.

Two references for a ring's greedy decode, both on the stages' own arithmetic (``LayerBlock``,
row-invariant, one torch thread per process):

- ``blocks_in_process``: the ring's layer blocks, one after another in this process. Against
  transformers in one process this isolates the cost of swarm's arithmetic itself.
- ``PipeRing``: the same blocks in one child process each, chained by ``multiprocessing`` pipes
  (pickle over a socketpair, no encryption, no libp2p, no trio, no scheduling). Against the blocks
  in one process this isolates the cost of process boundaries on this machine: each token wakes
  every process in turn, and each computes on a core that was idle.

Used by ``bench/ring_overhead.py --floor``; not imported by swarm.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch


def _stage_main(model_dir: str, start: int, end: int, conn_in, conn_out, ready) -> None:
    """A child: load layers [start, end) and compute every (pos, x) it receives, passing the output on."""
    torch.set_num_threads(1)
    from swarm.model.block import load_block
    from swarm.ranges import LayerRange

    block = load_block(model_dir, LayerRange(start, end), dtype="float32", device="cpu")
    ready.set()
    cache = None
    while True:
        msg = conn_in.recv()
        if msg is None:
            conn_out.send(None)
            return
        pos, x = msg
        if pos == 0:
            cache = block.new_cache(4096)
        y = block.forward(cache, pos, **({"token_ids": x} if block.is_head else {"hidden": x}))
        conn_out.send((pos, int(y[0, -1].argmax()) if block.is_tail else y))


class PipeRing:
    """Layer blocks in child processes chained by pipes: coordinator -> stage 0 -> ... -> coordinator.

    Args:
        model_dir: an HF-layout model directory. ranges: (start, end) per stage, tiling [0, L).
    Raises:
        RuntimeError: a child did not load its block within 300 s.
    """

    def __init__(self, model_dir, ranges: list[tuple[int, int]]):
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in range(len(ranges) + 1)]  # (recv end, send end)
        self.procs = []
        events = []
        for i, (a, b) in enumerate(ranges):
            ev = ctx.Event()
            p = ctx.Process(target=_stage_main, args=(str(model_dir), a, b, pipes[i][0], pipes[i + 1][1], ev),
                            daemon=True)
            p.start()
            self.procs.append(p)
            events.append(ev)
        self._to_head, self._from_tail = pipes[0][1], pipes[-1][0]
        for ev in events:
            if not ev.wait(300):
                self.close()
                raise RuntimeError("a pipe-ring stage did not load its block within 300 s")

    def decode(self, prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
        """Greedy decode: (tokens/s after the prompt, the generated ids)."""
        self._to_head.send((0, torch.tensor([prompt_ids])))
        _, nxt = self._from_tail.recv()
        out, pos = [nxt], len(prompt_ids)
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            self._to_head.send((pos, torch.tensor([[nxt]])))
            _, nxt = self._from_tail.recv()
            out.append(nxt)
            pos += 1
        return (tokens - 1) / (time.perf_counter() - t0), out

    def close(self) -> None:
        try:
            self._to_head.send(None)
        except (OSError, AttributeError):
            pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> PipeRing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def blocks_in_process(blocks, prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
    """Greedy decode through ``blocks`` (LayerBlocks tiling the model) in this process:
    (tokens/s after the prompt, the generated ids)."""
    caches = [b.new_cache(4096) for b in blocks]

    def step(pos: int, x: torch.Tensor) -> int:
        for b, c in zip(blocks, caches):
            x = b.forward(c, pos, **({"token_ids": x} if b.is_head else {"hidden": x}))
        return int(x[0, -1].argmax())

    nxt = step(0, torch.tensor([prompt_ids]))
    out, pos = [nxt], len(prompt_ids)
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        nxt = step(pos, torch.tensor([[nxt]]))
        out.append(nxt)
        pos += 1
    return (tokens - 1) / (time.perf_counter() - t0), out
