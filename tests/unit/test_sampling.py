"""Batched sampling: filters, penalties, logprobs, and seeds that ignore the rest of the batch."""

import torch

from llm_service.sampling import SamplingParams, apply_penalties, filter_logits
from tests.support.engine_support import Collector, make_engine, mixed_cases, plan_request, run_until_done
from tests.support.sampling import SampleInput, rows_from_lists, sample


def _inp(**kw):
    gen = None
    if kw.get("seed") is not None:
        gen = torch.Generator().manual_seed(kw["seed"])
    return SampleInput(SamplingParams(max_tokens=4, **kw), gen, kw.pop("prompt", ()), ())


def test_top_k_top_p_min_p_masks():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 3, dtype=torch.float64)
    rows = [_inp(temperature=1.0, top_k=2), _inp(temperature=1.0, top_p=0.7), _inp(temperature=1.0, min_p=0.3)]
    kept = torch.isfinite(filter_logits(logits, rows_from_lists(logits, rows)))
    assert kept[0].tolist() == [True, True, False, False, False]
    # softmax mass: 0.636, 0.234, ... -> top_p 0.7 keeps the first two
    assert kept[1].tolist() == [True, True, False, False, False]
    # min_p 0.3 keeps probs >= 0.3 * max: e^-1=0.37 yes, e^-2=0.14 no
    assert kept[2].tolist() == [True, True, False, False, False]


def test_penalties_follow_vllm_formulas():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]], dtype=torch.float64)
    inp = SampleInput(SamplingParams(max_tokens=4, repetition_penalty=2.0, frequency_penalty=0.5,
                                     presence_penalty=0.25), None, (0,), (1, 2, 2))
    out = apply_penalties(logits, rows_from_lists(logits, [inp]))[0].tolist()
    assert out[0] == 1.0  # prompt token, positive: divided
    assert out[1] == -4.0 - 0.5 - 0.25  # output once, negative: multiplied, then penalties
    assert out[2] == 0.5 - 1.0 - 0.25  # output twice
    assert out[3] == 0.5  # unseen


def test_greedy_rows_argmax_and_logprobs():
    logits = torch.randn(3, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rows = [SampleInput(SamplingParams(max_tokens=1, logprobs=3), None, (), ())] * 3
    result = sample(logits, rows)
    assert result.token_ids == logits.argmax(-1).tolist()
    lp = torch.log_softmax(logits, -1)
    for i in range(3):
        assert abs(result.logprobs[i] - lp[i].max().item()) < 1e-12
        assert [t for t, _ in result.top_logprobs[i]] == lp[i].topk(3).indices.tolist()


def test_seeded_rows_ignore_the_rest_of_the_batch():
    logits = torch.randn(4, 100, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def draw(batch_rows, steps=20):
        rows = {i: _inp(temperature=1.0, top_p=0.95, seed=123) if i == 2 else _inp(temperature=1.3) for i in batch_rows}
        got = []
        for _ in range(steps):
            tokens = sample(logits[batch_rows], [rows[i] for i in batch_rows]).token_ids
            got.append(tokens[batch_rows.index(2)])
        return got

    alone = draw([2])
    assert draw([0, 1, 2, 3]) == alone
    assert draw([3, 2]) == alone
    assert len(set(alone)) > 1  # it really samples


def test_engine_seeded_sampling_reproducible_regardless_of_batch(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    params = dict(temperature=0.9, top_k=50, top_p=0.95, seed=7, ignore_eos=True)

    def run(others: int, seed=7):
        engine = make_engine(model_dir)
        collector = Collector()
        collector.add(engine, plan_request(model_dir, mixed_cases()[1][1], "target", 12, **{**params, "seed": seed}))
        for i in range(others):
            collector.add(engine, plan_request(model_dir, mixed_cases()[6 + i][1], f"o{i}", 6 + i,
                                               temperature=1.0, ignore_eos=True))
        run_until_done(engine, collector)
        return collector.tokens("target")

    alone = run(0)
    assert run(5) == alone
    assert run(2) == alone
    assert run(0, seed=8) != alone
