"""Incremental detokenization: stop strings cut the text exactly; multi-byte characters never split."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from mmserve.detokenize import IncrementalDetokenizer

TEXT = "Hello wörld, 你好世界 🙂 and the cat sat on the mat. STOP here; more text after ### end"


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models["qwen2_vl"])


def _stream(tokenizer, ids, stop):
    detok = IncrementalDetokenizer(tokenizer, stop)
    out = []
    for t in ids:
        out.append(detok.add(t))
        assert "\ufffd" not in out[-1]
        if detok.stopped:
            break
    else:
        out.append(detok.flush())
    return "".join(out), detok.stopped


@pytest.mark.parametrize("stop", [["STOP"], ["sat on"], ["###", "cat"], ["好世"], ["🙂"], [" end"], ["absent"]])
def test_stop_strings_cut_exactly(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    full = tokenizer.decode(ids)
    assert full == TEXT
    text, stopped = _stream(tokenizer, ids, stop)
    cuts = [full.find(s) for s in stop if s in full]
    assert stopped == bool(cuts)
    assert text == (full[:min(cuts)] if cuts else full)


def test_multibyte_characters_stream_whole(tokenizer):
    ids = tokenizer.encode("🙂🙂 你好", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == "🙂🙂 你好"
    assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 703), max_size=40), stop=st.sampled_from(["", "e", "th", "!\"#", "\ufffd"]))
def test_deltas_add_up_to_the_whole_decode_cut_at_the_stop_string(tokenizer, ids, stop):
    detok = IncrementalDetokenizer(tokenizer, [stop] if stop else [])
    out = "".join(detok.add(i) for i in ids) + detok.flush()
    full = tokenizer.decode(ids, skip_special_tokens=True)
    cut = full.find(stop) if stop else -1
    assert out == (full[:cut] if cut != -1 else full)
