"""The packed Gated-DeltaNet layer (`llm_service.hybrid.gated_deltanet` through `PackedGatedDeltaNet`) ==
`transformers`' `Qwen3_5GatedDeltaNet` run on each sequence alone: several sequences packed in
one step, prefill chunks of any length mixed with decode tokens, state carried in slots."""

import random

import pytest
import torch

from llm_service.families.qwen3_5_text import PackedGatedDeltaNet, state_layers
from llm_service.hybrid.state_cache import StateBatch, StatePool

# The rule runs in float32 inside, as transformers' does: packing changes the float64 inputs in
# their last bits (other matmul blocking), which can round differently to float32; chunk
# boundaries other than the reference's move float32 rounding too. Nothing more.
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(**overrides):
    from transformers import Qwen3_5TextConfig

    kw = dict(hidden_size=48, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
              linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_conv_kernel_dim=4, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return Qwen3_5TextConfig(**{**kw, **overrides})


def _layers(config, seed=0):
    """(transformers layer, packed layer) with the same random float64 weights."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(seed)
    ref = Qwen3_5GatedDeltaNet(config, 0).to(torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        ref.A_log.copy_(torch.rand_like(ref.A_log).log())  # decays in (0, 1)
    packed = Qwen3_5GatedDeltaNet(config, 0).to(torch.float64)
    packed.load_state_dict(ref.state_dict())
    packed.__class__ = PackedGatedDeltaNet
    return ref.eval(), packed.eval()


def _reference(ref, config, x):
    """Outputs of `ref` on one whole sequence, and its final (conv, recurrent) state."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    with torch.no_grad():
        out = ref(x.unsqueeze(0), cache_params=cache)[0]
    return out, cache.layers[0].conv_states[0][0], cache.layers[0].recurrent_states[0][0]


def _run_packed(packed, config, seqs, steps, num_slots):
    """Run `steps` (each a list of (sequence index, chunk length)) over the packed layer; returns
    every sequence's outputs in order and the pool."""
    pool = StatePool(state_layers(config), num_slots, torch.float64, torch.device("cpu"))
    slot_of = {i: (7 * i + 3) % num_slots for i in range(len(seqs))}  # not the identity
    done = [0] * len(seqs)
    outs = [[] for _ in seqs]
    for step in steps:
        fresh = [slot_of[i] for i, _ in step if done[i] == 0]
        if fresh:
            pool.reset(torch.tensor(fresh))
        x = torch.cat([seqs[i][done[i]:done[i] + n] for i, n in step])
        batch = StateBatch(pool, torch.tensor([slot_of[i] for i, _ in step]), tuple(n for _, n in step))
        with torch.no_grad():
            y = packed(x.unsqueeze(0), state_batch=batch)[0]
        row = 0
        for i, n in step:
            outs[i].append(y[row:row + n])
            done[i] += n
            row += n
    return [torch.cat(o) for o in outs], pool, slot_of


def _random_steps(lengths, rng, max_chunk):
    """Each step takes a random chunk (1 .. max_chunk tokens) of a random subset of the unfinished
    sequences, in random order: prefill chunks of any size beside single tokens."""
    done, steps = [0] * len(lengths), []
    while any(d < n for d, n in zip(done, lengths)):
        live = [i for i, (d, n) in enumerate(zip(done, lengths)) if d < n]
        chosen = rng.sample(live, rng.randint(1, len(live)))
        step = []
        for i in chosen:
            n = min(lengths[i] - done[i], rng.choice([1, 1, 2, 5, rng.randint(1, max_chunk)]))
            step.append((i, n))
            done[i] += n
        steps.append(step)
    return steps


@pytest.mark.parametrize("seed", range(4))
def test_packed_steps_equal_each_sequence_alone(seed):
    config = _config()
    ref, packed = _layers(config, seed)
    rng = random.Random(seed)
    lengths = [150, 1, 70, 5, 3, 130, 64, 2]
    torch.manual_seed(100 + seed)
    seqs = [torch.randn(n, config.hidden_size, dtype=torch.float64) for n in lengths]
    steps = _random_steps(lengths, rng, max_chunk=140)
    assert any(len(s) > 1 and any(n == 1 for _, n in s) and any(n > 1 for _, n in s) for s in steps)
    outs, pool, slot_of = _run_packed(packed, config, seqs, steps, num_slots=11)
    for i, x in enumerate(seqs):
        expected, conv, recurrent = _reference(ref, config, x)
        torch.testing.assert_close(outs[i], expected, **TOL)
        torch.testing.assert_close(pool.recurrent[0][slot_of[i]], recurrent.float(), **TOL)
        width = config.linear_conv_kernel_dim - 1  # transformers keeps one more (unused) column
        torch.testing.assert_close(pool.conv[0][slot_of[i]], conv[:, -width:], rtol=0, atol=1e-12)


def test_prefill_then_decode_tokens_equal_the_cached_transformers_path():
    """The reference's own split (whole prompt, then one token at a time through its cache, its
    recurrent kernel for those), several sequences packed per step."""
    from transformers import DynamicCache

    config = _config()
    ref, packed = _layers(config, 7)
    torch.manual_seed(3)
    prompts = [17, 90, 3]
    seqs = [torch.randn(n + 5, config.hidden_size, dtype=torch.float64) for n in prompts]
    steps = [[(i, n) for i, n in enumerate(prompts)]] + [[(i, 1) for i in (2, 0, 1)]] * 5
    outs, _, _ = _run_packed(packed, config, seqs, steps, num_slots=3)
    for i, (x, n) in enumerate(zip(seqs, prompts)):
        cache = DynamicCache(config=config)
        with torch.no_grad():
            expected = [ref(x[None, :n], cache_params=cache)[0]]
            expected += [ref(x[None, t:t + 1], cache_params=cache)[0] for t in range(n, n + 5)]
        torch.testing.assert_close(outs[i], torch.cat(expected), **TOL)


def test_state_layers_follow_layer_types():
    config = _config(num_hidden_layers=8, layer_types=None)
    specs = state_layers(config)
    assert [s.layer_idx for s in specs] == [0, 1, 2, 4, 5, 6]  # 3 of every 4
    assert specs[0].conv_shape == (2 * 2 * 8 + 4 * 12, 3)
    assert specs[0].recurrent_shape == (4, 8, 12)
