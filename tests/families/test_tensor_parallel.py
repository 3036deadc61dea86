"""Tensor parallelism in the LLM runtime (CPU, gloo): greedy tokens at TP 2 (and TP 4, where KV
heads are fewer than ranks) equal `transformers`' monolithic `generate` (float64) for the
families the issue names, with images, video and every case of a family in flight at once; the
collectives per step are counted; a dead rank fails the replica as a whole, never hangs it."""

import os
import signal
import time

import pytest
import torch

from llm_service.model import tensor_parallel
from llm_service.model.language_model import LanguageModel
from mmserve.errors import ReplicaLost
from tests.support.cases import CASE_TOKENS, family_cases
from tests.support.engine_support import Collector, plan_request, run_until_done
from tests.support.reference import reference_generate
from tests.support.tensor_parallel import tp_engine


def _served(engine, model_dir: str, family: str, repeat: int = 1) -> dict[str, list[int]]:
    collector = Collector()
    names = []
    for k in range(repeat):
        for name, messages in family_cases(family).items():
            names.append(f"{name}#{k}")
            collector.add(engine, plan_request(model_dir, messages, names[-1], CASE_TOKENS[family]))
    run_until_done(engine, collector)
    for name in names:
        assert collector.finish_reason(name) in ("stop", "length"), (name, collector.events[name][-1])
    return {name: collector.tokens(name) for name in names}


def _expected(model_dir: str, family: str) -> dict[str, list[int]]:
    return {name: reference_generate(model_dir, messages, CASE_TOKENS[family])
            for name, messages in family_cases(family).items()}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "minicpmv4_6", "step3p7"])
def test_tp2_greedy_tokens_equal_monolithic(tiny_checkpoint, family):
    model_dir = tiny_checkpoint(family)
    with tp_engine(model_dir, 2) as engine:
        got = _served(engine, model_dir, family)
        counts, forwards = dict(engine.runner.tp.counts), engine.runner.num_forwards
        layers = len(engine.model.modules.decoder.layers)
    expected = _expected(model_dir, family)
    assert {name.split("#")[0]: tokens for name, tokens in got.items()} == expected
    # the collectives per step: one step message; one all-reduce for the embedding (split by
    # vocabulary), one per attention block and one per MLP block; one gather of the logits
    assert forwards > 0 and counts["all_reduce"] == (2 * layers + 1) * forwards, (counts, forwards)
    assert counts["gather"] == forwards
    if family == "minicpmv4_6":  # a hybrid model also sends its state-snapshot copies (prefix caching)
        assert counts["broadcast"] > forwards
    else:
        assert counts["broadcast"] == forwards
    (rank1,) = engine.rank_counts.values()
    assert rank1 == {**counts, "broadcast": counts["broadcast"] + 1}  # + the stop


def test_tp4_repeats_kv_heads_over_ranks_and_keeps_the_tokens(tiny_checkpoint):
    """MiniCPM-V 4.6's hybrid LM: 2 KV heads and 2 linear-attention key heads over 4 ranks (each
    rank holds one of each, shared by two ranks); every case twice (the second from the prefix
    cache: state snapshots restored on every rank)."""
    model_dir = tiny_checkpoint("minicpmv4_6")
    with tp_engine(model_dir, 4) as engine:
        runner = engine.runner
        assert runner.num_kv_heads == 1
        lin = next(layer.linear_attn for layer in engine.model.modules.decoder.layers if hasattr(layer, "linear_attn"))
        assert (lin.num_k_heads, lin.num_v_heads) == (1, 1)
        got = _served(engine, model_dir, "minicpmv4_6", repeat=2)
        assert engine.stats().num_snapshots > 0
    expected = _expected(model_dir, "minicpmv4_6")
    for name, tokens in got.items():
        assert tokens == expected[name.split("#")[0]], name
    assert len(engine.rank_counts) == 3


def test_tp2_chunked_prefill_steps_that_sample_nothing_keep_the_tokens(tiny_checkpoint):
    """A 3.5k-token prompt in 64-token chunks: most steps sample no row (the logits gather carries
    nothing), every rank still runs them."""
    model_dir = tiny_checkpoint("qwen2_vl")
    messages = family_cases("qwen2_vl")["long_prompt"]
    with tp_engine(model_dir, 2, max_num_batched_tokens=64, num_kv_blocks=400) as engine:
        collector = Collector()
        collector.add(engine, plan_request(model_dir, messages, "long", 8))
        run_until_done(engine, collector)
        assert engine.runner.num_forwards > 50
    assert collector.tokens("long") == reference_generate(model_dir, messages, 8)


def test_the_shards_of_every_rank_make_the_whole_weights(tiny_checkpoint):
    """The split rules cut each sharded tensor into pieces that, over the ranks, cover it exactly
    (KV heads repeated where fewer than ranks); the others are whole on every rank."""
    model = LanguageModel(tiny_checkpoint("qwen3_5_moe"), dtype="float32")
    state = model.modules.state_dict()
    for size in (2, 4):
        plans = [tensor_parallel.plan_shards(_fresh_decoder(model), r, size, vocab=model.vocab_size)
                 for r in range(size)]
        for name, full in state.items():
            parts = [plan.take(name, full) for plan in plans]
            if name not in plans[0].rules:
                assert all(p is full for p in parts), name
                continue
            if name in ("decoder.embed_tokens.weight", "lm_head.weight"):  # by vocabulary, the last slice padded
                joined = torch.cat(parts)
                assert torch.equal(joined[:model.vocab_size], full) and not joined[model.vocab_size:].any(), name
                continue
            if name.endswith(("k_proj.weight", "v_proj.weight")) and size == 4:  # 2 KV heads over 4 ranks
                parts = parts[::2]
            if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
                continue  # fused [q | k | v]: checked below
            dim = 1 if name.endswith(("o_proj.weight", "out_proj.weight", "mlp.down_proj.weight",
                                      "shared_expert.down_proj.weight")) else 2 if name.endswith("experts.down_proj") \
                else 1 if name.endswith("experts.gate_up_proj") else 0
            if name.endswith("experts.gate_up_proj"):
                gates, ups = zip(*(p.chunk(2, dim=1) for p in parts))
                assert torch.equal(torch.cat(gates + ups, dim=1), full), name
            else:
                assert torch.equal(torch.cat(parts, dim=dim), full), (name, size)


def _fresh_decoder(model: LanguageModel):
    """A decoder of the same shapes whose head counts `plan_shards` may change (not `model`'s)."""
    import copy

    return copy.deepcopy(model.modules.decoder)


def test_heads_that_do_not_split_are_refused(tiny_checkpoint):
    model = LanguageModel(tiny_checkpoint("qwen2_vl"), dtype="float32")
    with pytest.raises(ValueError, match="4 attention heads"):
        tensor_parallel.plan_shards(_fresh_decoder(model), 0, 3)
    assert tensor_parallel.part(2, 3, 4) == (1, 1) and tensor_parallel.part(8, 3, 4) == (6, 2)
    with pytest.raises(ValueError, match="split over neither"):
        tensor_parallel.part(3, 0, 2)


def test_a_dead_rank_fails_the_replica_as_a_whole(tiny_checkpoint):
    """Rank 1 killed mid-generation: every request on rank 0 ends with `ReplicaLost` (which the
    router resubmits elsewhere), the engine reports itself unhealthy and refuses new work; no hang."""
    model_dir = tiny_checkpoint("qwen2_vl")
    messages = family_cases("qwen2_vl")["one_image"]
    with tp_engine(model_dir, 2) as engine:
        events = Collector()
        for i in range(3):
            events.add(engine, plan_request(model_dir, messages, f"r{i}", 400))
        engine.step()  # prefill: the group works
        os.kill(engine.rank_pids[1], signal.SIGKILL)
        engine.start()
        deadline = time.monotonic() + 60
        while not events.all_done() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert events.all_done(), "requests hung after a rank died"
        for rid in events.events:
            assert isinstance(events.events[rid][-1].error, ReplicaLost), events.events[rid][-1]
        assert "tensor-parallel group broken" in engine.health(stall_timeout_s=60)
        with pytest.raises(ReplicaLost):
            engine.add_request(plan_request(model_dir, messages, "late", 4), lambda event: None)
