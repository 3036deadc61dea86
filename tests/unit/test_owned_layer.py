"""The engine's own decoder (llm_service/model/layers.py) against `transformers`' text model on the
same weights: a prefill in two chunks and decode steps through the paged KV pool give the hidden
states of one full `transformers` forward (float64: to rounding; float32: close), Qwen3-VL's
DeepStack features included; its packed projections are the checkpoint's q | k | v and gate | up,
and a tensor-parallel rank's are its slice of each part."""

from __future__ import annotations

import pytest
import torch

from llm_service.model import attention, layers
from llm_service.model.attention import AttentionBatch
from llm_service.model.kv_cache import allocate_pool
from llm_service.model.language_model import LanguageModel
from tests.support.reference import load_reference

BLOCK = 4
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
IMAGE = slice(4, 10)  # the rows of the image in `_positions`
TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-4, atol=1e-4)}


def _positions(length: int) -> torch.Tensor:
    """`(3, length)` M-RoPE rows: text, a 2 x 3 image grid, text (the rows differ on the image)."""
    t = torch.arange(4)
    image = torch.stack([torch.full((6,), 4), 4 + torch.arange(6) // 3, 4 + torch.arange(6) % 3])
    head = torch.stack([t, t, t])
    tail = torch.arange(length - 10) + 7
    return torch.cat([head, image, torch.stack([tail, tail, tail])], dim=1)


def _batch(pool: torch.Tensor, table: torch.Tensor, start: int, end: int) -> AttentionBatch:
    """One sequence's tokens `start .. end` as a step over its block `table` (SDPA backend)."""
    ctx_slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:end]
    batch = AttentionBatch(kv_pool=pool, slot_mapping=ctx_slots[start:end], cu_seqlens_q=torch.tensor(
        [0, end - start], dtype=torch.int32), context_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=table[None].to(torch.int32), max_query_len=end - start, max_context_len=end, backend="sdpa")
    batch.gather_slots, batch.masks = attention.sdpa_metadata([end - start], [end], [ctx_slots], torch.device("cpu"))
    return batch


def _deepstack(model_dir: str, hidden: int, dtype: torch.dtype, start: int, end: int) -> dict:
    """Qwen3-VL: the DeepStack arguments of a forward over rows `start .. end` (the image rows among them)."""
    from transformers import AutoConfig

    vision = AutoConfig.from_pretrained(model_dir).vision_config
    lo, hi = max(IMAGE.start, start), min(IMAGE.stop, end)
    if not hasattr(vision, "deepstack_visual_indexes") or lo >= hi:
        return {}
    g = torch.Generator().manual_seed(1)
    features = [torch.randn(IMAGE.stop - IMAGE.start, hidden, generator=g, dtype=torch.float64).to(dtype)
                for _ in vision.deepstack_visual_indexes]
    mask = torch.zeros(end - start, dtype=torch.bool)
    mask[lo - start:hi - start] = True
    return {"visual_pos_masks": mask[None],
            "deepstack_visual_embeds": [f[lo - IMAGE.start:hi - IMAGE.start] for f in features]}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_prefill_and_decode_equal_the_transformers_decoder(tiny_checkpoint, family, dtype):
    model_dir = tiny_checkpoint(family)
    model = LanguageModel(model_dir, dtype=str(dtype).removeprefix("torch."))
    decoder, hidden = model.modules.decoder, model.text_config.hidden_size
    assert isinstance(decoder, layers.Decoder)
    reference = load_reference(model_dir, dtype)[1].model.language_model
    length, steps = 16, (0, 7, 13, 14, 15, 16)  # a prefill in two chunks (the image across them), three decodes
    embeds = torch.randn(length, hidden, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    positions = _positions(length)
    with torch.inference_mode():
        want = reference(inputs_embeds=embeds[None], position_ids=positions[:, None],
                         **_deepstack(model_dir, hidden, dtype, 0, length)).last_hidden_state[0]
        pool = allocate_pool(len(decoder.layers), 8, BLOCK, model.num_kv_heads, decoder.layers[0].self_attn.head_dim,
                             dtype, torch.device("cpu"))
        table = torch.tensor([5, 2, 7, 0])  # blocks out of order
        got = torch.cat([decoder(inputs_embeds=embeds[None, start:end], position_ids=positions[:, None, start:end],
                                 paged_batch=_batch(pool, table, start, end),
                                 **_deepstack(model_dir, hidden, dtype, start, end)).last_hidden_state[0]
                         for start, end in zip(steps, steps[1:])])
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_linears_expose_their_slices_and_hold_the_checkpoints_projections(tiny_checkpoint, family):
    model_dir = tiny_checkpoint(family)
    model = LanguageModel(model_dir, dtype="float64")
    reference = load_reference(model_dir)[1].model.language_model
    text = model.text_config
    head_dim = reference.layers[0].self_attn.head_dim
    q, kv = text.num_attention_heads * head_dim, text.num_key_value_heads * head_dim
    for layer, ref in zip(model.modules.decoder.layers, reference.layers):
        qkv = layer.self_attn.qkv_proj
        assert qkv.output_sizes == (q, kv, kv)
        assert qkv.slices() == (slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv))
        for piece, proj in zip(qkv.slices(), (ref.self_attn.q_proj, ref.self_attn.k_proj, ref.self_attn.v_proj)):
            assert torch.equal(qkv.weight[piece], proj.weight)
            assert (qkv.bias is None) == (proj.bias is None)
            assert proj.bias is None or torch.equal(qkv.bias[piece], proj.bias)
        gate_up = layer.mlp.gate_up_proj
        assert gate_up.output_sizes == (text.intermediate_size,) * 2 and gate_up.bias is None
        gate, up = gate_up.split(gate_up.weight.T)
        assert torch.equal(gate.T, ref.mlp.gate_proj.weight) and torch.equal(up.T, ref.mlp.up_proj.weight)
    assert not any(k.endswith(("q_proj.weight", "gate_proj.weight")) for k in model.modules.state_dict())


def test_the_fused_norm_is_the_residual_add_then_the_norm():
    """`norm(x, residual)` rounds as `transformers`' `residual + x` followed by its RMSNorm."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm

    g = torch.Generator().manual_seed(3)
    ref = Qwen2VLRMSNorm(48, eps=1e-6).to(torch.bfloat16)
    ref.weight.data = torch.randn(48, generator=g).to(torch.bfloat16)
    norm = layers.RMSNorm(48, 1e-6, torch.bfloat16)
    norm.weight.data = ref.weight.data.clone()
    x, residual = (torch.randn(5, 48, generator=g).to(torch.bfloat16) for _ in range(2))
    out, total = norm(x, residual)
    assert torch.equal(total, residual + x) and torch.equal(out, ref(residual + x))
    out, same = norm(x)
    assert same is x and torch.equal(out, ref(x))


def test_a_tensor_parallel_rank_packs_its_own_slice_of_each_projection(tiny_checkpoint):
    """2 ranks: half the heads each; 4 ranks: a quarter of the query heads, and the 2 KV heads
    each shared by two ranks. A rank's q | k | v is its slice of each, and its slices say so."""
    import copy

    from llm_service.model.tensor_parallel import plan_shards

    model = LanguageModel(tiny_checkpoint("qwen2_vl"), dtype="float64")
    name = "decoder.layers.0.self_attn.qkv_proj.weight"
    full = model.modules.state_dict()[name]
    q, kv, _ = model.modules.decoder.layers[0].self_attn.qkv_proj.output_sizes
    for size, shared in ((2, 1), (4, 2)):
        decoders = [copy.deepcopy(model.modules.decoder) for _ in range(size)]
        parts = [plan_shards(d, rank, size).take(name, full) for rank, d in enumerate(decoders)]
        sizes = {d.layers[0].self_attn.qkv_proj.output_sizes for d in decoders}
        assert sizes == {(q // size, kv * shared // size, kv * shared // size)}
        pieces = [part.split(list(next(iter(sizes)))) for part in parts]
        assert torch.equal(torch.cat([p[0] for p in pieces]), full[:q])
        for i, whole in ((1, full[q:q + kv]), (2, full[q + kv:])):
            assert torch.equal(torch.cat([p[i] for p in pieces[::shared]]), whole)


def test_rotary_rows_from_a_transformers_that_does_not_mix_them_are_mixed_as_its_attention_did(tiny_checkpoint):
    """transformers 5.0's Qwen2-VL rotary module returns cos/sin of each M-RoPE row `(3, 1, T, D)` and
    its attention mixes them by `mrope_section`; later ones mix inside the module. The owned decoder
    takes either: the rows, mixed by `mrope_mix`, are what today's module returns."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    decoder = LanguageModel(tiny_checkpoint("qwen2_vl"), dtype="float64").modules.decoder
    rotary, positions = decoder.rotary_emb, _positions(16)[:, None]
    assert isinstance(rotary, Qwen2VLRotaryEmbedding) and decoder.mrope_section
    x = torch.zeros(1, dtype=torch.float64)
    freqs = positions[..., None].double() * rotary.inv_freq.double()  # transformers 5.0's forward
    per_row = torch.cat((freqs, freqs), dim=-1)
    rows = tuple((f(per_row) * rotary.attention_scaling).to(x.dtype) for f in (torch.cos, torch.sin))
    assert rows[0].shape[0] == 3 and rows[0].dim() == 4
    mixed = [layers.mrope_mix(r, decoder.mrope_section) for r in rows]
    for got, want in zip(mixed, rotary(x, positions)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(mixed[0], rows[0][0])  # the image's rows do differ: the mix matters here

    class Unmixed(torch.nn.Module):  # the decoder on such a module: the same hidden states
        def forward(self, x, position_ids):
            return rows

    embeds = torch.randn(1, 16, decoder.norm.weight.shape[0], generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)

    def run() -> torch.Tensor:
        pool = allocate_pool(len(decoder.layers), 8, BLOCK, decoder.layers[0].self_attn.num_key_value_heads,
                             decoder.layers[0].self_attn.head_dim, torch.float64, torch.device("cpu"))
        with torch.inference_mode():
            return decoder(inputs_embeds=embeds, position_ids=positions,
                           paged_batch=_batch(pool, torch.tensor([0, 1, 2, 3]), 0, 16)).last_hidden_state

    want = run()
    decoder.rotary_emb = Unmixed()
    torch.testing.assert_close(run(), want, rtol=1e-6, atol=1e-6)
