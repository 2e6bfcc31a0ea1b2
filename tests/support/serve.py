"""``swarm serve`` for tests: the real server (``serve_api``) in a thread with its own trio loop."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import trio

from swarm.serve.app import serve_api
from swarm.serve.config import ServeConfig

# a Llama-2-style chat template (stories260k has none)
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + "
                 "' [/INST]' }}{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")


def stories_with_chat_template(stories_dir: Path, parent: Path, generation_config: dict | None = None) -> Path:
    """A copy of stories260k under ``parent`` with :data:`CHAT_TEMPLATE` (and ``generation_config``, when
    given, as its generation_config.json); returns its directory."""
    d = parent / "stories260k"
    shutil.copytree(stories_dir, d)
    if generation_config is not None:
        (d / "generation_config.json").write_text(json.dumps(generation_config))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": CHAT_TEMPLATE}))
    return d


class LoopThread:
    """A trio loop in a daemon thread, for tests that drive in-process servers from the test thread.

    ``start(main)`` runs ``await main(nursery, box)`` there and returns once it has returned (the
    servers it started keep running in ``nursery``), raising what it raised; ``box`` is the dict it
    fills for the test thread. ``stop()`` cancels the loop and joins the thread.
    """

    def __init__(self) -> None:
        self.box: dict = {}
        self.thread: threading.Thread | None = None

    def start(self, main, timeout_s: float = 120.0) -> dict:
        async def run():
            async with trio.open_nursery() as nursery:
                self.box["token"] = trio.lowlevel.current_trio_token()
                self.box["scope"] = nursery.cancel_scope
                await main(nursery, self.box)
                self.box["ready"] = True

        def target():
            try:
                trio.run(run)
            except BaseException as exc:  # reported to the test thread
                self.box["error"] = exc

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()
        end = time.monotonic() + timeout_s
        while "ready" not in self.box and "error" not in self.box:
            assert time.monotonic() < end, "the ring did not start"
            time.sleep(0.05)
        if "error" in self.box:
            raise self.box["error"]
        return self.box

    def stop(self) -> None:
        if "scope" in self.box:
            try:
                trio.from_thread.run_sync(self.box["scope"].cancel, trio_token=self.box["token"])
            except trio.RunFinishedError:
                pass
        if self.thread is not None:
            self.thread.join(30)


class Server:
    """``serve_api`` in a thread with its own trio loop; ``stop()`` cancels it."""

    def __init__(self, spec, key_dir: Path, **serve_kwargs):
        self.box: dict = {}
        self.serve_kwargs = serve_kwargs  # more ServeConfig fields (e.g. dashboard_receipts)
        self.thread = threading.Thread(target=self._run, args=(spec, key_dir), daemon=True)
        self.thread.start()
        end = time.monotonic() + 120
        while "info" not in self.box and "error" not in self.box:
            assert time.monotonic() < end, "the server did not start"
            time.sleep(0.05)
        if "error" in self.box:
            raise self.box["error"]
        self.url = self.box["info"]["url"]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def _run(self, spec, key_dir):
        async def main():
            async with trio.open_nursery() as nursery:
                self.box["token"] = trio.lowlevel.current_trio_token()
                self.box["scope"] = nursery.cancel_scope
                config = ServeConfig.of(host="127.0.0.1", port=0, key_path=key_dir / "coord.key", **self.serve_kwargs)
                self.box["info"] = await nursery.start(lambda task_status: serve_api(spec, config,
                                                                                     task_status=task_status))

        try:
            trio.run(main)
        except BaseException as exc:  # reported to the test thread
            self.box["error"] = exc

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def stop(self):
        if "scope" in self.box:
            trio.from_thread.run_sync(self.box["scope"].cancel, trio_token=self.box["token"])
        self.thread.join(20)
