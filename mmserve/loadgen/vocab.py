"""A tokenizer of Qwen2's real vocabulary size, built here without the hub (bench/grammar.py).

Qwen2's tokenizer has 151,643 byte-level BPE tokens, its special tokens after them, and the model's
embedding and logits pad the vocabulary to 151,936 rows. `qwen_size_tokenizer()` trains the tiny
models' tokenizer (`mmserve.tiny.tokenizer.build_tokenizer`) on a larger deterministic corpus (JSON
documents, CJK runs, seeded pseudo-words with Zipf frequencies), cached under the temporary
directory. Its token strings are not Qwen's (whole pseudo-words); its size, byte-level alphabet and
split pattern are.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import tempfile
from pathlib import Path

QWEN2_BPE_TOKENS = 151_643  # regular (BPE) tokens of Qwen2 / Qwen2-VL / Qwen2.5-VL
QWEN2_MODEL_VOCAB = 151_936  # rows of their embedding and logits (the vocabulary padded)
_RECIPE = 2  # bump when the corpus changes: part of the cache directory's name

_ONSETS = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl br cr gr kl qu sp".split()
_VOWELS = "a e i o u y ai ea ou io ie".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x", "tion", "ing", "ed"]
_KEYS = ("id name type value status count total price amount date time email phone address street city "
         "country code description title items quantity unit tax discount currency notes url tags score "
         "user_id created_at updated_at is_active metadata").split()


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    words: dict[str, None] = {}  # in the order drawn, each once
    while len(words) < n:
        words["".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                      for _ in range(rng.choice((1, 1, 2, 2, 3))))] = None
    return list(words)


def _json_value(rng: random.Random, words: list[str], depth: int):
    kind = rng.choice(("str", "str", "int", "num", "bool", "null", "obj", "arr") if depth < 3 else ("str", "int"))
    if kind == "str":
        return " ".join(rng.choice(words[:2000]) for _ in range(rng.randint(1, 4)))
    if kind == "int":
        return rng.randint(-10 ** rng.randint(1, 6), 10 ** rng.randint(1, 9))
    if kind == "num":
        return round(rng.uniform(-1000, 1000), rng.randint(1, 4))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "obj":
        return {rng.choice(_KEYS): _json_value(rng, words, depth + 1) for _ in range(rng.randint(1, 6))}
    return [_json_value(rng, words, depth + 1) for _ in range(rng.randint(0, 4))]


def corpus(bpe_tokens: int, seed: int = 0) -> list[str]:
    """The lines added to the tiny corpus: enough distinct pseudo-words (1-3 syllables) and CJK
    characters (runs of them: 2- and 3-character tokens, as Qwen's) for `bpe_tokens` merges."""
    rng = random.Random(seed)
    words = _pseudo_words(rng, max(2000, bpe_tokens))
    cum = list(itertools.accumulate(1 / (i + 1) ** 0.8 for i in range(len(words))))
    lines = []
    for _ in range(max(1000, bpe_tokens // 3)):
        picked = rng.choices(words, cum_weights=cum, k=rng.randint(4, 16))
        lines.append(" ".join(w.capitalize() if rng.random() < 0.1 else w for w in picked) + rng.choice(".,?!:;"))
    hanzi = [chr(0x4E00 + i) for i in rng.sample(range(20000), min(8000, bpe_tokens // 16))]
    hanzi_cum = list(itertools.accumulate(1 / (i + 1) ** 0.7 for i in range(len(hanzi))))
    lines += ["".join(rng.choices(hanzi, cum_weights=hanzi_cum, k=rng.randint(5, 30))) for _ in range(bpe_tokens // 10)]
    for i in range(max(500, bpe_tokens // 30)):
        doc = {rng.choice(_KEYS): _json_value(rng, words, 0) for _ in range(rng.randint(2, 8))}
        style = i % 3
        lines.append(json.dumps(doc, ensure_ascii=False, indent=2 if style == 2 else None,
                                separators=(",", ":") if style == 0 else None))
    lines += hanzi + words + [" " + w for w in words]  # each seen alone, and each word after a space
    return lines


def qwen_size_tokenizer(bpe_tokens: int = QWEN2_BPE_TOKENS, seed: int = 0, cache_dir: str | Path | None = None):
    """A `PreTrainedTokenizerFast`: `bpe_tokens` BPE tokens then the Qwen2-VL special tokens
    (`<|endoftext|>` = `bpe_tokens`, EOS `<|im_end|>`), cached under `cache_dir` (default: the temporary
    directory)."""
    from transformers import PreTrainedTokenizerFast

    from mmserve.tiny.tokenizer import SPECIAL_TOKENS, build_tokenizer

    root = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir())
    where = root / f"mmserve-vocab-r{_RECIPE}-{bpe_tokens}-{seed}"
    if (where / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(where))
    tokenizer = build_tokenizer(seed, bpe_tokens + len(SPECIAL_TOKENS), extra_corpus=corpus(bpe_tokens, seed))
    first_special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if len(tokenizer) != bpe_tokens + len(SPECIAL_TOKENS) or first_special != bpe_tokens:
        raise RuntimeError(f"the corpus gave {len(tokenizer)} tokens, not {bpe_tokens} + {len(SPECIAL_TOKENS)}")
    partial = root / f"{where.name}.{os.getpid()}.partial"
    tokenizer.save_pretrained(str(partial))
    try:
        partial.rename(where)  # atomic: a concurrent build's copy wins, this one is dropped
    except OSError:
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(str(where))
