"""Device and dtype selection; the CUDA path (bf16 and float32) when a GPU is present."""

import pytest
import torch

from swarm.errors import ConfigError
from swarm.model.block import load_block, pick_device, pick_dtype
from swarm.ranges import LayerRange
from tests.support.models import chained_greedy


def test_auto_device_and_dtype_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the CPU defaults are checked on CPU-only machines")
    dev = pick_device("auto")
    assert dev.type in ("cpu", "mps")
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_unavailable_device_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        pick_device("cuda")


def test_unknown_dtype():
    with pytest.raises(ConfigError, match="unknown dtype"):
        pick_dtype("int4", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_blocks_match_transformers_on_cuda(synthetic, dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    from transformers import AutoModelForCausalLM

    d = synthetic("llama", dtype="float32")
    prompt = [1, 5, 9, 3, 7, 2, 8]
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=getattr(torch, dtype)).cuda().eval()
    ref = model.generate(torch.tensor([prompt]).cuda(), max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = ref[0, len(prompt):].tolist()
    blocks = [load_block(d, LayerRange(a, b), dtype=dtype, device="cuda") for a, b in [(0, 1), (1, 3), (3, 4)]]
    assert all(b.device.type == "cuda" for b in blocks)
    assert chained_greedy(blocks, prompt, 12) == ref
