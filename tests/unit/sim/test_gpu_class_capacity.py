"""inferlb's default GPU classes follow the simulator's engine physics (one rule, docs/engine.md)."""

from __future__ import annotations

import pytest

from sim.engines.hardware import (
    GPU_CLASSES,
    MODELS,
    REFERENCE_OUTPUT_TOKENS,
    REFERENCE_PROMPT_TOKENS,
    relative_capacity,
    saturated_requests_per_s,
)
from sim.engines.llm import BLOCK_SIZE
from xds_server.config.model import DEFAULT_GPU_CLASSES


@pytest.mark.parametrize("gpu", sorted(GPU_CLASSES))
def test_each_default_gpu_class_is_the_physics_rounded_to_two_decimals(gpu):
    assert DEFAULT_GPU_CLASSES[gpu]["capacity"] == round(relative_capacity(gpu, block_size=BLOCK_SIZE), 2)
    assert DEFAULT_GPU_CLASSES[gpu]["memory_mib"] == GPU_CLASSES[gpu].memory_mib


def test_the_saturated_rate_follows_the_batch_the_kv_cache_allows():
    """An A10 (24 GiB) holds 29 408 KV tokens beside Llama-3.1-8B: 25 requests of 1 152 tokens, not
    its 256 slots; an A100 holds 442 272: its 256 slots are the limit."""
    m = MODELS["llama-3.1-8b"]
    a10, a100 = GPU_CLASSES["a10"], GPU_CLASSES["a100"]
    rate = saturated_requests_per_s(m, a10, block_size=BLOCK_SIZE)
    assert rate == pytest.approx(1e6 / (136.4888 * 1024 + 33.4952 * 128 + 32119.27 * 128 / 25), rel=1e-4)
    assert saturated_requests_per_s(m, a100, block_size=BLOCK_SIZE) == pytest.approx(
        1e6 / (47.8374 * 1024 + 18.2056 * 128 + 16441.53 * 128 / 256), rel=1e-4)
    assert (REFERENCE_PROMPT_TOKENS, REFERENCE_OUTPUT_TOKENS) == (1024, 128)
    with pytest.raises(ValueError, match="does not fit"):
        saturated_requests_per_s(m, a10, block_size=BLOCK_SIZE, prompt_tokens=40000)
