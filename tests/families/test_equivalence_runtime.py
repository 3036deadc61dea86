"""Greedy tokens of router -> encoder runtime -> LLM runtime == transformers' monolithic generate."""

import pytest

from tests.support.cases import cases
from tests.support.pipeline import runtimes, served_generate
from tests.support.reference import reference_generate, reference_inputs

MAX_TOKENS = 12


@pytest.mark.parametrize("case", list(cases()))
def test_greedy_tokens_equal_monolithic(model_dir, case):
    messages = cases()[case]
    expected = reference_generate(model_dir, messages, MAX_TOKENS)
    assert len(expected) > 0
    assert served_generate(model_dir, messages, MAX_TOKENS) == expected


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
    from tests.support.media_factory import image_bytes

    def msg(seed):
        return [{"role": "user", "content": [{"type": "image", "bytes": image_bytes(64, 96, seed)},
                                             {"type": "text", "text": "Describe."}]}]

    assert served_generate(model_dir, msg(1), MAX_TOKENS) != served_generate(model_dir, msg(2), MAX_TOKENS)
