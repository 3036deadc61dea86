"""The Triton attention kernel vs plain PyTorch attention over contiguous per-sequence K/V.

On CPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest before
Triton is imported); on CUDA it is compiled. float32 and float16 are checked on CPU; bfloat16
`tl.dot` gives wrong results in the interpreter (Triton 3.8), so bf16 runs on the GPU only.
"""

import random

import pytest
import torch

pytestmark = pytest.mark.kernel
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def reference(q, keys, values, q_lens, scale, window=None, causal=True):
    """Each sequence alone: its queries (the last `q_len` positions) over its contiguous K/V."""
    outs, offset = [], 0
    for k, v, n in zip(keys, values, q_lens):
        length, group = k.shape[0], q.shape[1] // k.shape[1]
        qs = q[offset:offset + n].double().transpose(0, 1)
        offset += n
        ks, vs = (t.double().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        q_pos, k_pos = torch.arange(length - n, length)[:, None], torch.arange(length)[None, :]
        allowed = k_pos <= q_pos if causal else torch.ones(n, length, dtype=torch.bool)
        if window:
            allowed &= k_pos > q_pos - window
        scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(~allowed.to(qs.device), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs)


def random_paged_case(seed: int, page_size: int, dtype=torch.float32):
    """Sequences with random context and query lengths (prefill, chunk over a prefix, decode),
    their contiguous K/V, and the same K/V scattered into a pool through random block tables."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kv_heads, group, head_dim = rng.choice((1, 2)), rng.choice((1, 2, 3, 4)), rng.choice((16, 24, 32))
    num_seqs = rng.randint(1, 4)
    max_len = rng.choice((40, 100)) if page_size < 256 else 300
    ctx = [rng.randint(1, max_len) for _ in range(num_seqs)]
    q_lens = [rng.choice((c, 1, rng.randint(1, c))) for c in ctx]
    blocks_needed = [-(-c // page_size) for c in ctx]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    pool_k = torch.randn(num_blocks, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    pool_v = torch.randn(num_blocks, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    width = max(blocks_needed) + 1
    tables = torch.tensor([[free[0]] * width] * num_seqs, dtype=torch.int32)  # padding: any valid id
    keys, values = [], []
    for i, (c, nb) in enumerate(zip(ctx, blocks_needed)):
        ids = [free.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(c, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(c, kv_heads, head_dim, generator=gen).to(dtype)
        slots = (torch.tensor(ids)[:, None] * page_size + torch.arange(page_size)).flatten()[:c]
        pool_k.view(-1, kv_heads, head_dim)[slots] = k
        pool_v.view(-1, kv_heads, head_dim)[slots] = v
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    window = rng.choice((None, None, rng.randint(1, max_len)))
    return q, pool_k, pool_v, tables, ctx, q_lens, keys, values, window


def run_paged(q, pool_k, pool_v, tables, ctx, q_lens, window):
    from mmserve.kernels.triton_attention import paged_attention

    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    dev = dict(device=DEVICE)
    return paged_attention(q.to(**dev), pool_k.to(**dev), pool_v.to(**dev), cu.to(**dev),
                           torch.tensor(ctx, dtype=torch.int32, **dev), tables.to(**dev), max(q_lens),
                           q.shape[-1] ** -0.5, window).cpu()


@pytest.mark.parametrize("page_size", [16, 32, 256, 8])
@pytest.mark.parametrize("seed", range(3))
def test_paged_kernel_matches_reference(page_size, seed):
    q, pool_k, pool_v, tables, ctx, q_lens, keys, values, window = random_paged_case(seed * 7 + page_size, page_size)
    out = run_paged(q, pool_k, pool_v, tables, ctx, q_lens, window)
    expected = reference(q, keys, values, q_lens, q.shape[-1] ** -0.5, window)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", [1, 5, 21])
def test_sliding_window_decode_and_chunk_skip_old_blocks(window):
    """Long prefix, short window: whole key tiles before the window are skipped or masked."""
    gen = torch.Generator().manual_seed(window)
    length = 150
    k, v = torch.randn(length, 1, 16, generator=gen), torch.randn(length, 1, 16, generator=gen)
    pool_k, pool_v = torch.zeros(12, 16, 1, 16), torch.zeros(12, 16, 1, 16)
    ids = torch.randperm(12, generator=gen)[:10]
    slots = (ids[:, None] * 16 + torch.arange(16)).flatten()[:length]
    pool_k.view(-1, 1, 16)[slots], pool_v.view(-1, 1, 16)[slots] = k, v
    q_lens = [1, 7]
    q = torch.randn(sum(q_lens), 2, 16, generator=gen)
    tables = ids.to(torch.int32).repeat(2, 1)
    out = run_paged(q, pool_k, pool_v, tables, [length, length], q_lens, window)
    expected = reference(q, [k, k], [v, v], q_lens, 16 ** -0.5, window)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("splits", [2, 3, 16])
@pytest.mark.parametrize("seed", range(3))
def test_split_k_decode_matches_reference(splits, seed):
    """Decode (one query per sequence) over key slices, merged by log-sum-exp: slices past a
    short context hold no key, a sliding window leaves early slices empty."""
    from mmserve.kernels.triton_attention import paged_attention

    q, pool_k, pool_v, tables, ctx, _, keys, values, window = random_paged_case(seed * 5 + splits, 16)
    q_lens = [1] * len(ctx)
    q = q[:len(ctx)].contiguous()
    for window in (window, None, 3):
        cu = torch.arange(len(ctx) + 1, dtype=torch.int32)
        dev = dict(device=DEVICE)
        out = paged_attention(q.to(**dev), pool_k.to(**dev), pool_v.to(**dev), cu.to(**dev),
                              torch.tensor(ctx, dtype=torch.int32, **dev), tables.to(**dev), 1, q.shape[-1] ** -0.5,
                              window, splits=splits).cpu()
        expected = reference(q, keys, values, q_lens, q.shape[-1] ** -0.5, window)
        torch.testing.assert_close(out.double(), expected, **TOLERANCE[torch.float32])


def test_decode_splits_fill_the_device_only_for_long_contexts():
    from mmserve.kernels.triton_attention import MAX_SPLITS, MIN_SPLIT_KEYS, decode_splits

    cpu = torch.device("cpu")  # 8 "SMs" in the interpreter
    assert decode_splits(1, 2, 100, cpu) == 1  # short context: never split
    assert decode_splits(1, 2, 4 * MIN_SPLIT_KEYS, cpu) == 4  # as many slices as the context allows
    assert decode_splits(1, 2, 64 * MIN_SPLIT_KEYS, cpu) == 8  # 2 programs x 8 slices = 2 x 8 SMs
    assert decode_splits(1, 1, 64 * MIN_SPLIT_KEYS, cpu) == MAX_SPLITS
    assert decode_splits(64, 8, 64 * MIN_SPLIT_KEYS, cpu) == 1  # a full batch fills the device alone


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_paged_kernel_half_precision(dtype):
    q, pool_k, pool_v, tables, ctx, q_lens, keys, values, window = random_paged_case(5, 16, dtype)
    out = run_paged(q, pool_k, pool_v, tables, ctx, q_lens, window)
    expected = reference(q, keys, values, q_lens, q.shape[-1] ** -0.5, window)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("head_dim", [8, 80])
def test_varlen_kernel_is_bidirectional_within_segments(head_dim):
    from mmserve.kernels.triton_attention import varlen_attention

    gen = torch.Generator().manual_seed(head_dim)
    lens = [5, 33, 1, 20]
    q, k, v = (torch.randn(sum(lens), 2, head_dim, generator=gen) for _ in range(3))
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    out = varlen_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu.to(DEVICE), max(lens), 0.3).cpu()
    expected = reference(q, torch.split(k, lens), torch.split(v, lens), lens, 0.3, causal=False)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[torch.float32])


def compile_for_sm90() -> list[str]:
    """Compile the kernels' main variants to a Hopper cubin (ptxas ships with Triton; no GPU needed)."""
    import triton

    from mmserve.kernels.triton_attention import _attention_kernel, _combine_kernel
    from tests.support.sm90 import compile_sm90

    indices = {n: "*i32" for n in ("cu_seqlens_q", "kv_lens", "block_tables", "kv_starts")}
    compiled = []
    variants = [("bf16", True, False, 6, 128, 16, 1), ("bf16", True, True, 6, 128, 64, 1),
                ("fp32", True, False, 2, 16, 16, 1), ("bf16", False, False, 1, 80, 64, 1),
                ("bf16", True, False, 6, 128, 16, 8)]
    for dtype, paged, sliding, group, head_dim, block_m, splits in variants:
        constants = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                         BLOCK_M=block_m, BLOCK_N=32 if dtype == "fp32" else 64, PAGE_SIZE=16, PAGED=paged,
                         CAUSAL=paged, SLIDING=sliding, PRECISION="ieee", SPLITS=splits)
        pointers = {**indices, **{n: f"*{dtype}" for n in ("Q", "K", "V", "O")},
                    **{n: "*fp32" if splits > 1 else f"*{dtype}" for n in ("Part", "Lse")}}
        size = compile_sm90(_attention_kernel, constants, pointers, {"scale": "fp32"}, num_stages=2)
        compiled.append(f"{dtype} paged={paged} sliding={sliding} splits={splits}: {size} bytes")
    size = compile_sm90(_combine_kernel, dict(HEAD_DIM=128, BLOCK_D=128, SPLITS=8, BLOCK_S=8),
                        {"Part": "*fp32", "Lse": "*fp32", "O": "*bf16"})
    compiled.append(f"combine bf16 splits=8: {size} bytes")
    return compiled


@pytest.mark.skipif(DEVICE == "cuda", reason="compiled and run for real on CUDA")
def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter does not type-check like the compiler: compile the real thing too."""
    from tests.support.sm90 import run_without_interpreter

    assert run_without_interpreter("tests.gpu.test_attention_kernel", "compile_for_sm90").count("bytes") == 6
