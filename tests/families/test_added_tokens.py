"""Every tiny tokenizer adds the tokens its family's released tokenizer adds, with the same flags
(`special`, `normalized`, `lstrip`, `rstrip`; ids differ): the table in
tests/data/real_added_tokens.json names its sources. A tiny tokenizer that marks `<tool_call>`
special where the real one does not hid a fault of the served tool calls (issue 58)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmserve.tiny import FAMILIES

TABLE = json.loads((Path(__file__).parents[1] / "data" / "real_added_tokens.json").read_text())
FLAGS = ("special", "normalized", "lstrip", "rstrip")


def test_the_table_covers_every_family():
    assert set(FAMILIES) <= set(TABLE)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tiny_tokenizer_adds_the_real_ones_tokens_with_their_flags(tiny_checkpoint, family):
    from transformers import AutoTokenizer

    real = TABLE[family]
    added = {t.content: t for t in AutoTokenizer.from_pretrained(tiny_checkpoint(family)).added_tokens_decoder.values()}
    wanted = {t["content"]: t for t in real["tokens"]}
    missing = sorted(set(wanted) - set(added))
    assert not missing, f"{family}: the tiny tokenizer lacks {missing} ({real['checkpoint']} has them)"
    if real["complete"]:
        assert set(added) == set(wanted), f"{family}: tokens the real one does not add: {set(added) - set(wanted)}"
    for content, token in wanted.items():
        for flag in FLAGS:
            if token[flag] is not None:
                assert getattr(added[content], flag) == token[flag], f"{family}: {content} {flag}"
