"""The ring over real libp2p (in-process stages) == transformers greedy generate, token for token."""

import pytest

from tests.conftest import FAMILY_CONFIGS, reference_greedy
from tests.ring_util import run_inprocess

PROMPT = [1, 5, 9, 3, 7, 2, 8, 11, 4]
SPLITS = {
    1: [(0, 4)],
    2: [(0, 3), (3, 4)],  # uneven
    3: [(0, 1), (1, 3), (3, 4)],  # one-layer head and tail
    4: [(0, 1), (1, 2), (2, 3), (3, 4)],
}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_ring_matches_transformers(synthetic, tmp_path, family, stages):
    d = synthetic(family)
    ref = reference_greedy(d, PROMPT, 12, "float64")
    assert run_inprocess(d, SPLITS[stages], PROMPT, 12, tmp_path) == ref


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 5)], [(0, 1), (1, 4), (4, 5)]])
def test_ring_stories260k(stories_dir, tmp_path, ranges):
    prompt = [1, 403, 407, 261, 378]
    ref = reference_greedy(stories_dir, prompt, 40, "float32")
    assert run_inprocess(stories_dir, ranges, prompt, 40, tmp_path, dtype="float32", num_layers=5) == ref
