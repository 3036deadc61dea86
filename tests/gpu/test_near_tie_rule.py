"""The bf16 near-tie rule of the GPU tests (tests/support/reference.py), checked on CPU: a split from the
reference is allowed only where the reference's logit of our token nearly ties its best one."""

import pytest
import torch

from tests.support.cases import cases
from tests.support.reference import NEAR_TIE, GreedyReference, NearTieTally, greedy_reference, reference_generate, split_from_reference

EOS = 2


def _reference(tokens: list[int], best: list[int], runner_up: list[float]) -> GreedyReference:
    """Logits over 5 ids: `best[i]` scores 1.0, id 4 scores `runner_up[i]`, the rest 0."""
    logits = []
    for b, r in zip(best, runner_up):
        scores = torch.zeros(5)
        scores[4] = r
        scores[b] = 1.0
        logits.append(scores)
    return GreedyReference(tokens, tuple(logits), frozenset({EOS}))


def test_identical_tokens_are_no_split_and_a_served_eos_stop_counts_as_its_eos():
    ref = _reference([3, 1, EOS], [3, 1, EOS], [0.0] * 3)
    assert split_from_reference([3, 1, EOS], False, ref) is None
    assert split_from_reference([3, 1], True, ref) is None  # served streams leave the EOS out


def test_a_split_reports_how_far_below_the_best_logit_our_token_was():
    ref = _reference([3, 1, 1], [3, 1, 1], [0.0, 0.95, 0.0])
    split = split_from_reference([3, 4, 0], False, ref)
    assert (split.index, split.gap) == (1, pytest.approx(0.05))
    tally = NearTieTally()
    tally.check("near", [3, 4, 0], False, ref)
    assert tally.exact == 0 and tally.splits[0][:2] == ("near", 1)
    with pytest.raises(AssertionError, match="far: split at token 0"):
        tally.check("far", [0, 1, 1], False, ref)  # id 0 scored 1.0 below the best
    assert NEAR_TIE < 1.0


def test_stopping_early_is_a_split_at_the_eos_we_emitted():
    ref = _reference([3, 1, 1], [3, 1, 1], [0.0] * 3)
    split = split_from_reference([3], True, ref)
    assert split.index == 1 and split.gap == pytest.approx(1.0)  # our EOS scored 0 against 1.0


def test_greedy_reference_is_generate_with_its_eos_and_one_logit_row_per_token(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    messages = cases()["one_image"]
    ref = greedy_reference(model_dir, messages, 6, torch.float64, "cpu", key="one_image")
    tokens = ref.tokens[:-1] if ref.tokens[-1] in ref.eos else ref.tokens
    assert tokens == reference_generate(model_dir, messages, 6)
    assert len(ref.logits) == len(ref.tokens)
    assert all(int(row.argmax()) == t for row, t in zip(ref.logits, ref.tokens))
    assert greedy_reference(model_dir, messages, 6, torch.float64, "cpu", key="one_image") is ref
