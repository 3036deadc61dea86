"""Gated-DeltaNet linear attention over one packed engine step, state kept in per-sequence slots.

A step packs several sequences into `T` rows: prefill chunks (a prompt's first chunk or a later
one) and single decode tokens. `transformers`' fallbacks (`causal_conv1d_fn`,
`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`) take `(batch, time)` tensors
of one length and a cache object, so a packed step runs here instead, with the same arithmetic:

- `causal_conv1d`: the short depthwise convolution, each sequence continuing from the last
  inputs kept in its slot (zeros for a fresh sequence). One `conv1d` call over the whole step:
  every sequence's kept inputs and new tokens are laid side by side, so no window crosses
  sequences; the new last inputs go back to the slot.
- `gated_delta_rule`: single tokens take the recurrent form, batched over sequences; chunks take
  the chunked (UT-transform) form, each sequence padded to whole chunks of `CHUNK_SIZE` and the
  scan over chunks batched over sequences (a padding chunk leaves a state exactly unchanged:
  zero keys, zero log-decay). Both in float32 as `transformers` computes them, the state read
  from and written back to the slot rows. Plain torch: runs on CPU and on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from llm_service.hybrid.state_cache import StateBatch
from llm_service.model.transfer import ints, to_device

CHUNK_SIZE = 64  # transformers' chunk_size: the same padding gives the same float32 rounding


class _ConvLayout(NamedTuple):
    total: int  # columns of the side-by-side layout
    state_cols: torch.Tensor  # (B * width,) where each sequence's kept inputs go
    token_cols: torch.Tensor  # (T,) where each packed row goes
    tail_cols: torch.Tensor  # (B * width,) the last `width` columns of each sequence: its new kept inputs


class _RuleLayout(NamedTuple):
    decode_rows: torch.Tensor  # packed rows of the single-token sequences
    decode_seqs: torch.Tensor  # their indices in the step
    chunk_rows: torch.Tensor  # packed rows of the multi-token sequences, in order
    chunk_seqs: torch.Tensor  # their indices in the step
    chunk_index: torch.Tensor  # where each of `chunk_rows` sits in the padded `(seqs * chunks * CHUNK_SIZE)` layout
    num_chunks: int  # chunks of the longest one


def _conv_layout(batch: StateBatch, width: int, device: torch.device) -> _ConvLayout:
    key = ("conv", width)
    if key not in batch.layouts:
        state, tokens, tail, col = [], [], [], 0
        for n in batch.q_lens:
            state.append(torch.arange(col, col + width))
            tokens.append(torch.arange(col + width, col + width + n))
            tail.append(torch.arange(col + n, col + n + width))
            col += width + n
        cat = lambda ts: to_device(torch.cat(ts), device)  # noqa: E731
        batch.layouts[key] = _ConvLayout(col, cat(state), cat(tokens), cat(tail))
    return batch.layouts[key]


def _rule_layout(batch: StateBatch, device: torch.device) -> _RuleLayout:
    key = ("rule", CHUNK_SIZE)
    if key not in batch.layouts:
        cu = batch.cu_seqlens
        decode = [i for i, n in enumerate(batch.q_lens) if n == 1]
        chunked = [i for i, n in enumerate(batch.q_lens) if n > 1]
        num_chunks = max((-(-batch.q_lens[i] // CHUNK_SIZE) for i in chunked), default=0)
        span = num_chunks * CHUNK_SIZE
        rows = [torch.arange(cu[i], cu[i + 1]) for i in chunked]
        index = [k * span + torch.arange(batch.q_lens[i]) for k, i in enumerate(chunked)]
        as_tensor = lambda xs: ints(xs, device)  # noqa: E731
        cat = lambda ts: to_device(torch.cat(ts), device) if ts else as_tensor([])  # noqa: E731
        batch.layouts[key] = _RuleLayout(as_tensor([cu[i] for i in decode]), as_tensor(decode), cat(rows),
                                         as_tensor(chunked), cat(index), num_chunks)
    return batch.layouts[key]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  batch: StateBatch, activation: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """Depthwise causal convolution of the packed `x` `(T, channels)` with `weight`
    `(channels, kernel)`; `conv_state` `(slots, channels, kernel - 1)` holds each sequence's last
    inputs (read at `batch.slots`, written back). Returns `(T, channels)` in `x`'s dtype."""
    channels, width = x.shape[1], weight.shape[-1] - 1
    lay = _conv_layout(batch, width, x.device)
    num_seqs = len(batch.q_lens)
    ext = x.new_empty(channels, lay.total)
    ext[:, lay.state_cols] = conv_state[batch.slots].to(x.dtype).permute(1, 0, 2).reshape(channels, -1)
    ext[:, lay.token_cols] = x.T
    new_state = ext[:, lay.tail_cols].reshape(channels, num_seqs, width).permute(1, 0, 2)
    conv_state[batch.slots] = new_state.to(conv_state.dtype)
    out = F.conv1d(ext.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=channels)[0]
    out = out[:, lay.token_cols - width].T  # the window ending at each token starts `width` columns earlier
    if activation is not None:
        out = activation(out)
    return out.to(x.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """The gated delta rule over the packed step, queries and keys L2-normalised.

    `query`, `key` `(T, k_heads, k_dim)`, `value` `(T, v_heads, v_dim)`, `g` (log-decay, <= 0)
    and `beta` `(T, v_heads)`; `state` `(slots, v_heads, k_dim, v_dim)` float32, read at
    `batch.slots` and written back. Returns `(T, v_heads, v_dim)` in `query`'s dtype."""
    out_dtype = query.dtype
    v_heads = value.shape[1]
    if key.shape[1] != v_heads:  # each query/key head serves v_heads // k_heads consecutive value heads
        query = query.repeat_interleave(v_heads // key.shape[1], dim=1)
        key = key.repeat_interleave(v_heads // key.shape[1], dim=1)
    query, key, value, beta, g = (t.to(torch.float32) for t in (query, key, value, beta, g))
    query, key = _l2norm(query), _l2norm(key)
    lay = _rule_layout(batch, query.device)
    out = torch.empty_like(value)
    if len(lay.decode_rows):
        slots, r = batch.slots[lay.decode_seqs], lay.decode_rows
        out[r], state[slots] = _recurrent_step(query[r], key[r], value[r], g[r], beta[r], state[slots])
    if len(lay.chunk_rows):
        slots, r = batch.slots[lay.chunk_seqs], lay.chunk_rows
        out[r], state[slots] = _chunked(query[r], key[r], value[r], g[r], beta[r], state[slots], lay)
    return out.to(out_dtype)


def _recurrent_step(q, k, v, g, beta, s):
    """One token per sequence: `q`, `k` `(B, H, Dk)`, `v` `(B, H, Dv)`, `g`, `beta` `(B, H)`, state
    `s` `(B, H, Dk, Dv)` -> (output `(B, H, Dv)`, new state), as `torch_recurrent_gated_delta_rule`."""
    q = q / (q.shape[-1] ** 0.5)
    s = s * g.exp()[..., None, None]
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(dim=-2), s


def _chunked(q, k, v, g, beta, s, lay: _RuleLayout):
    """Multi-token sequences, rows in order, padded per sequence to `lay.num_chunks` chunks:
    -> (outputs of the rows, new states), as `torch_chunk_gated_delta_rule`."""
    num_seqs, heads, c = len(lay.chunk_seqs), q.shape[1], CHUNK_SIZE

    def padded(x):  # rows (R, H, ...) -> (seqs, H, chunks * C, ...), zeros after each sequence's end
        out = x.new_zeros(num_seqs * lay.num_chunks * c, *x.shape[1:])
        out[lay.chunk_index] = x
        out = out.view(num_seqs, lay.num_chunks * c, *x.shape[1:])
        return out.transpose(1, 2).contiguous()

    query, key, value, beta, decay = padded(q), padded(k), padded(v), padded(beta), padded(g)
    query = query * query.shape[-1] ** -0.5
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (x.reshape(num_seqs, heads, -1, c, x.shape[-1]) for x in (query, key, k_beta, v_beta))
    decay = decay.reshape(num_seqs, heads, -1, c)
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(lay.num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = query[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(num_seqs, heads, -1, out.shape[-1]).transpose(1, 2).reshape(-1, heads, out.shape[-1])
    return out[lay.chunk_index], s
