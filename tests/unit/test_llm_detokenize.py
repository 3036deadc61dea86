"""Incremental detokenization: stop strings cut the text exactly; multi-byte characters never split."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from mmserve.request.detokenize import IncrementalDetokenizer

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


@settings(max_examples=200, deadline=None)
@given(data=st.data(), stop=st.sampled_from(["", "e", "<|box", "\ufffd"]))
def test_marker_ids_give_their_text_even_when_special_and_the_rest_decodes_as_before(tokenizer, data, stop):
    """The tool-call tags of a tokenizer that marks them special (here two special tokens stand in)
    reach the text, so that the parser sees them; between them the text is each run's decode."""
    markers = {tokenizer.convert_tokens_to_ids(t): t for t in ("<|box_start|>", "<|box_end|>")}
    ids = data.draw(st.lists(st.integers(0, 703) | st.sampled_from(sorted(markers)), max_size=40))
    detok = IncrementalDetokenizer(tokenizer, [stop] if stop else [], markers)
    out = "".join(detok.add(i) for i in ids) + detok.flush()
    runs, run = [], []
    for i in ids:
        if i in markers:
            runs += [tokenizer.decode(run, skip_special_tokens=True), markers[i]]
            run = []
        else:
            run.append(i)
    full = "".join(runs) + tokenizer.decode(run, skip_special_tokens=True)
    cut = full.find(stop) if stop else -1
    assert out == (full[:cut] if cut != -1 else full)


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def tiny_tokenizer(request):
    """Two of the tiny byte-level BPE tokenizers: Qwen's special tokens, LLaVA's (with `<s>`)."""
    models = request.getfixturevalue("tiny_models" if request.param == "qwen2_vl" else "llava_models")
    return AutoTokenizer.from_pretrained(models[request.param])


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_deltas_add_up_to_the_whole_decode_with_special_ids_and_split_characters(tiny_tokenizer, data):
    tok = tiny_tokenizer
    texts = st.text(st.sampled_from("ab é你好🙂\n"), max_size=6)
    pieces = st.one_of(
        st.integers(0, len(tok) - 1).map(lambda i: [i]),  # the byte alphabet splits characters
        st.sampled_from(tok.all_special_ids).map(lambda i: [i]),
        texts.map(lambda text: tok.encode(text, add_special_tokens=False)),
    )
    ids = [i for piece in data.draw(st.lists(pieces, max_size=20)) for i in piece]
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.add(i) for i in ids) + detok.flush()
    assert out == tok.decode(ids, skip_special_tokens=True)


def test_a_decoder_that_rewrites_released_text_restarts_instead_of_raising():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "a": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>")
    ids = [2 + 0x41, 2 + 0xE4, 1]  # "A", then a lone lead byte: byte fallback turns both into U+FFFD
    assert tok.decode(ids) == "\ufffd\ufffda"
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] + [detok.flush()] == ["A", "", "a", ""]
