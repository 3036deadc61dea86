"""Sliding-window masks of the paged engine's CPU path == transformers' sliding-window mask function."""

import random

import torch

from llm_service.attention import sdpa_metadata, sdpa_window_masks, sliding_windows


def test_window_masks_follow_transformers_per_sequence_positions():
    from transformers.masking_utils import sliding_window_causal_mask_function

    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 4)
        ctx = [rng.randint(1, 40) for _ in range(n)]
        q = [rng.randint(1, c) for c in ctx]  # chunked prefill / decode: the last q of ctx tokens are new
        windows = (3, rng.randint(1, 50))
        slots = [torch.arange(c) for c in ctx]
        _, causal = sdpa_metadata(q, ctx, slots, torch.device("cpu"))
        masks = sdpa_window_masks(q, ctx, windows, torch.device("cpu"))
        assert set(masks) == set(windows)
        for w, mask in masks.items():
            allowed = sliding_window_causal_mask_function(w)
            expected = torch.zeros_like(causal)
            row = col = 0
            for ql, cl in zip(q, ctx):
                for i in range(ql):
                    for j in range(cl):
                        expected[row + i, col + j] = bool(allowed(0, 0, torch.tensor(cl - ql + i), torch.tensor(j)))
                row, col = row + ql, col + cl
            assert torch.equal(mask, expected)
            assert torch.equal(mask & causal, mask)
        assert sdpa_window_masks(q, ctx, (), torch.device("cpu")) == {}


def test_sliding_windows_of_a_decoder_are_its_sliding_layers_windows():
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                         sliding_window=7, max_window_layers=1)
    assert sliding_windows(Qwen2Model(config)) == (7,)
    config.use_sliding_window = False
    config.layer_types = ["full_attention"] * 3
    assert sliding_windows(Qwen2Model(config)) == ()
