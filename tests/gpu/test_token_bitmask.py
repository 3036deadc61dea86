"""Structured outputs' masks applied in one kernel (mmserve/kernels/triton_bitmask.py; Triton's
interpreter on CPU): the logits the bitmask's bits keep, on the rows named, as the CPU path of
`llm_service.grammar.StepMasks` masks them."""

from __future__ import annotations

import pytest
import torch

from llm_service.grammar import StepMasks
from mmserve.kernels.triton_bitmask import apply_token_bitmask_

pytestmark = pytest.mark.kernel
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _unpacked(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, vocab) bool: bit t % 32 of word t // 32; tokens past the words refused."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.flatten(1).bool()[:, :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab, words, rows", [
    (100, 4, None),             # the last word part-used
    (2048 + 37, 66, [3, 0]),    # two blocks a row; two of five rows, out of order
    (70, 2, [1]),               # a vocabulary padded past the tokenizer's words: its tail refused
    (64, 3, [0, 2]),            # a word past the logits ignored
])
def test_the_kernel_keeps_what_the_bits_allow_on_the_rows_named(vocab, words, rows, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    n = 5 if rows is None else len(rows)
    bitmask = torch.randint(-2**31, 2**31, (n, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -1  # every bit of a word, the sign bit's too
    expected = logits.clone()
    for r, row in enumerate(range(5) if rows is None else rows):
        expected[row].masked_fill_(~_unpacked(bitmask[r:r + 1], vocab)[0], float("-inf"))

    got = logits.to(DEVICE)
    at = None if rows is None else torch.tensor(rows, device=DEVICE)
    apply_token_bitmask_(got, bitmask.to(DEVICE), at)
    assert torch.equal(got.cpu(), expected)


def test_the_kernel_masks_as_the_cpu_path_does():
    """The same rows of logits masked by the kernel and by `StepMasks`' CPU addends (+0 or -inf)."""
    vocab = 151_936 // 16  # Qwen's logits, cut for the interpreter
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31, (3, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    cpu = logits + StepMasks(vocab)._addends(bitmask, logits.dtype)[:, :vocab]
    kernel = logits.to(DEVICE)
    apply_token_bitmask_(kernel, bitmask.to(DEVICE))
    assert torch.equal(kernel.cpu(), cpu)
