"""The replicas' warm-up leaves no trace: an engine warmed up reads as a fresh one (stats, prefix
cache, state snapshots) and serves the same tokens; it runs before the engine thread only."""

from __future__ import annotations

import pytest

from llm_service.engine.llm_engine import LLMRequest
from llm_service.sampling import SamplingParams
from tests.support.engine_support import Collector, make_engine, run_until_done


def _serve_one(engine) -> tuple[list[int], object]:
    """A request whose prompt starts with the warm-up's prompt (ids 1..24): a prefix-cache hit if
    the warm-up had left its blocks there."""
    collector = Collector()
    prompt = tuple(range(1, 25)) + (7, 8, 9, 10)
    collector.add(engine, LLMRequest("after", prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    run_until_done(engine, collector)
    return collector.tokens("after"), engine.stats()


@pytest.mark.parametrize("which", ["qwen2_vl", "hybrid"])
def test_engine_warm_up_leaves_no_trace(which, tiny_models, minicpmv_dir):
    model_dir = minicpmv_dir if which == "hybrid" else tiny_models["qwen2_vl"]  # hybrid: state slots, snapshots
    fresh, warmed = make_engine(model_dir, block_size=16), make_engine(model_dir, block_size=16)
    assert warmed.config.enable_prefix_caching
    warmed.warm_up()
    assert warmed.stats() == fresh.stats() and warmed.num_forwards == 0
    (fresh_tokens, fresh_stats), (warm_tokens, warm_stats) = _serve_one(fresh), _serve_one(warmed)
    assert warm_tokens == fresh_tokens and len(warm_tokens) == 4
    assert warm_stats == fresh_stats and warm_stats.num_cached_tokens == 0 and warm_stats.num_generated == 4


def test_engine_warm_up_runs_before_the_engine_thread(tiny_models):
    engine = make_engine(tiny_models["qwen2_vl"])
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            engine.warm_up()
    finally:
        engine.shutdown()
