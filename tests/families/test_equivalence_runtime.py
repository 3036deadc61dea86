"""Greedy tokens of router -> encoder runtime -> LLM runtime == transformers' monolithic generate
(float64), for every family's tiny checkpoint and every one of its cases (tests/support/cases.py);
then the Qwen2-VL families' own checks."""

import pytest

from tests.support.cases import CASE_TOKENS, FAMILIES, cases, family_cases
from tests.support.pipeline import runtimes, served_generate
from tests.support.reference import reference_generate, reference_inputs

MAX_TOKENS = 12


@pytest.mark.parametrize("checkpoint,case", [(f, c) for f in FAMILIES for c in family_cases(f)])
def test_greedy_tokens_equal_monolithic(tiny_checkpoint, checkpoint, case):
    """Default engine settings (chunked prefill for the long prompts); the reference runs every
    step (no early end), so an empty answer cannot pass."""
    model_dir, max_tokens = tiny_checkpoint(checkpoint), CASE_TOKENS[checkpoint]
    messages = family_cases(checkpoint)[case]
    expected = reference_generate(model_dir, messages, max_tokens)
    assert len(expected) == max_tokens
    assert served_generate(model_dir, messages, max_tokens) == expected


def test_long_prompt_is_long(model_dir):
    inputs = reference_inputs(model_dir, cases()["long_prompt"])
    assert inputs["input_ids"].shape[1] > 1000


def test_prompt_ids_equal_processor(model_dir):
    """The router's expanded prompt equals the processor's input_ids for every case."""
    from tests.support.pipeline import to_planner_messages

    planner, _, _ = runtimes(model_dir)
    for name, messages in cases().items():
        plan = planner.plan(to_planner_messages(messages))
        assert plan.token_ids == reference_inputs(model_dir, messages)["input_ids"][0].tolist(), name


def test_output_depends_on_image(model_dir):
    """Guards the tests' power: a different image changes the greedy tokens."""
    from tests.support.cases import image, text, user

    def msg(seed):
        return user(image(64, 96, seed), text("Describe."))

    assert served_generate(model_dir, msg(1), MAX_TOKENS) != served_generate(model_dir, msg(2), MAX_TOKENS)
