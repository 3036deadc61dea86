"""What the tiny builders share: the tokenizer trainer (byte-level BPE, Qwen2's split pattern, a
fixed corpus: the same seed and special tokens give the same vocabulary) and the small text config."""

from __future__ import annotations

from pathlib import Path

# The Qwen2-VL special tokens: the default set (Qwen-style ChatML tokenizers).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

# Qwen2.5's added tokens after the special ones, plain (`special: false`) in the released tokenizers;
# Qwen3's add the tool-response and thinking tags (tests/data/real_added_tokens.json).
QWEN2_5_ADDED_TOKENS = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
QWEN3_ADDED_TOKENS = QWEN2_5_ADDED_TOKENS + ("<tool_response>", "</tool_response>", "<think>", "</think>")

# Qwen2's pre-tokenizer split pattern.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = (
    "the a an of to in is it that this what where who how why image video picture photo frame "
    "describe show tell me about color colour red green blue yellow black white cat dog bird car "
    "tree house sky sea mountain person people left right top bottom middle small large many one "
    "two three four five six seven eight nine ten hello world assistant user system helpful answer "
    "question please thank you see look there are is was were will would can could should model "
    "vision language token embedding encoder decoder serve request response stream batch cache"
).split()


def chat_template(name: str) -> str:
    """A tiny checkpoint's chat template: `templates/<name>.jinja` less the file's final newline."""
    return (Path(__file__).parent / "templates" / f"{name}.jinja").read_text().removesuffix("\n")


def _corpus(seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(4000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        sep = rng.choice([" ", " ", " ", ", ", ". "])
        lines.append(sep.join(words).capitalize() + rng.choice([".", "?", "!", "", "\n"]))
    lines.append("0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ café naïve 日本語 😀")
    return lines


def build_tokenizer(seed: int, vocab_size: int, special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
                    eos_token: str = "<|im_end|>", pad_token: str = "<|endoftext|>", bos_token: str | None = None,
                    extra_corpus: list[str] | None = None, added_tokens: tuple[str, ...] = (),
                    extra_special_tokens: dict[str, str] | None = None):
    """Byte-level BPE trained on a fixed corpus; with `bos_token`, it is prepended to every encoding.
    `extra_corpus`: lines trained on after the fixed ones (`mmserve/loadgen/vocab.py`: a vocabulary
    of a real model's size). `special_tokens`, then `added_tokens` (plain: decoded even when special
    tokens are skipped), are added tokens, none normalized, as in the released Qwen tokenizers;
    `extra_special_tokens` names some of them (`{"image_token": "<|image_pad|>"}`: MiniCPM-V's)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(special_tokens) - len(added_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed) + list(extra_corpus or ()), trainer=trainer)
    tok.add_special_tokens(list(special_tokens))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    bos = {} if bos_token is None else {"bos_token": bos_token, "add_bos_token": True}
    named = {"extra_special_tokens": extra_special_tokens} if extra_special_tokens else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token, unk_token=None,
                                   **bos, **named, model_max_length=4096, clean_up_tokenization_spaces=False,
                                   split_special_tokens=False)


def text_config(tokenizer, bos: str | None = "<|endoftext|>", eos: str = "<|im_end|>", pad: str = "<|endoftext|>",
                **overrides) -> dict:
    """The tiny decoder every family's LM starts from (2 layers of width 64, GQA 4/2); `overrides` change it."""
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids(bos) if bos else None, eos_token_id=ids(eos), pad_token_id=ids(pad),
    ) | overrides


def vision_token_ids(tokenizer) -> dict[str, int]:
    """The Qwen-VL configs' placeholder and vision-span token ids, from the Qwen2-VL special tokens."""
    ids = tokenizer.convert_tokens_to_ids
    return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
