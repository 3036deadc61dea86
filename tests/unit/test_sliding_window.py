"""Sliding-window masks of the paged engine's CPU path == transformers' sliding-window mask function."""

import random

import torch

from llm_service.model.attention import layer_windows, sdpa_metadata


def test_window_masks_follow_transformers_per_sequence_positions():
    from transformers.masking_utils import sliding_window_causal_mask_function

    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 4)
        ctx = [rng.randint(1, 40) for _ in range(n)]
        q = [rng.randint(1, c) for c in ctx]  # chunked prefill / decode: the last q of ctx tokens are new
        windows = (3, rng.randint(1, 50))
        slots = [torch.arange(c) for c in ctx]
        _, masks = sdpa_metadata(q, ctx, slots, torch.device("cpu"), (None, *windows))
        causal = masks.pop(None)
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


def test_layer_windows_are_the_sliding_layers_windows():
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                         sliding_window=7, max_window_layers=1)
    assert layer_windows(config, 3) == (None, 7, 7)  # the layers past max_window_layers slide
    config.layer_types = ["full_attention"] * 3
    assert layer_windows(config, 3) == (None, None, None)
