"""`mmserve serve`'s GPU shares when none are given (deployments/cli/gpu_shares.py): one GPU split in
fractions that fit both models, several GPUs whole, refusals that say which flags to give; and the
command line's use of them (explicit flags win, nothing chosen without a GPU or with --device cpu)."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deployments.cli import gpu_shares as shares_module
from deployments.cli.gpu_shares import ENCODER_HEADROOM_BYTES, choose_gpu_shares
from deployments.cli.local_serve import RefusedToStart, app_args, gpu_shares

GIB = 1 << 30


def test_one_h100_with_qwen2_vl_2b_gives_the_encoder_a_tenth():
    shares = choose_gpu_shares(1, 80 * GIB, encoder_bytes=int(1.3 * GIB), llm_bytes=int(3.1 * GIB))
    assert (shares.encoder, shares.llm) == (0.1, 0.9)
    assert "one GPU of 80 GiB" in shares.why


def test_one_24_gib_gpu_with_a_7b_lm_gives_the_encoder_its_weights_and_headroom():
    shares = choose_gpu_shares(1, 24 * GIB, encoder_bytes=int(1.35 * GIB), llm_bytes=int(15.2 * GIB))
    assert (shares.encoder, shares.llm) == (0.25, 0.75)  # (1.35 + 4) / 24 = 0.22, rounded up to a twentieth


def test_the_encoder_takes_at_most_half():
    assert choose_gpu_shares(1, 8 * GIB, encoder_bytes=6 * GIB, llm_bytes=GIB).encoder == 0.5


def test_an_lm_that_leaves_no_room_for_its_kv_cache_is_refused_naming_the_flags():
    with pytest.raises(ValueError, match="leave no room for its KV cache.*--encoder-gpus and --llm-gpus"):
        choose_gpu_shares(1, 16 * GIB, encoder_bytes=int(1.35 * GIB), llm_bytes=int(15.2 * GIB))


def test_several_gpus_are_given_whole():
    assert choose_gpu_shares(2, 80 * GIB, GIB, 15 * GIB)[:2] == (1.0, 1.0)
    assert choose_gpu_shares(3, 80 * GIB, GIB, 15 * GIB, tensor_parallel_size=2)[:2] == (1.0, 1.0)


@pytest.mark.parametrize("gpus", [1, 2])
def test_tensor_parallelism_without_a_gpu_left_for_the_encoder_is_refused(gpus):
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 takes 2 whole GPUs and the encoder one more"):
        choose_gpu_shares(gpus, 80 * GIB, GIB, 15 * GIB, tensor_parallel_size=2)


@given(memory_gib=st.integers(4, 192), encoder_gib=st.floats(0, 40), llm_gib=st.floats(0, 200))
def test_one_gpu_is_shared_in_twentieths_that_sum_to_one_and_fit_both(memory_gib, encoder_gib, llm_gib):
    memory, encoder_bytes, llm_bytes = memory_gib * GIB, int(encoder_gib * GIB), int(llm_gib * GIB)
    try:
        shares = choose_gpu_shares(1, memory, encoder_bytes, llm_bytes)
    except ValueError:
        return
    assert shares.encoder + shares.llm == pytest.approx(1.0)
    assert round(shares.encoder / 0.05, 6).is_integer() and 0.1 <= shares.encoder <= 0.5
    assert shares.encoder * memory >= min(encoder_bytes + ENCODER_HEADROOM_BYTES, memory / 2)
    assert llm_bytes < 0.9 * shares.llm * memory


def _flags(**given) -> argparse.Namespace:
    base = dict(model=None, dtype="auto", device="auto", num_cpus=2, encoder_gpus=None, llm_gpus=None,
                max_model_len=None, tensor_parallel_size=1, lora=[])
    return argparse.Namespace(**{**base, **given})


def test_on_a_gpu_host_the_serve_command_takes_the_chosen_shares_and_says_them(tiny_models, monkeypatch, capsys):
    monkeypatch.setattr(shares_module, "visible_gpu_memory", lambda: [80 * GIB])
    shares = gpu_shares(_flags(), tiny_models["qwen2_vl"])
    args = app_args(_flags(), None, shares)
    assert (args.encoder.num_gpus, args.llm.num_gpus) == (0.1, 0.9)
    assert "GPU shares: encoder 0.1, LLM 0.9 (one GPU of 80 GiB" in capsys.readouterr().out


def test_explicit_flags_win_and_nothing_is_chosen_without_a_gpu_or_on_the_cpu(tiny_models, monkeypatch):
    model = tiny_models["qwen2_vl"]
    monkeypatch.setattr(shares_module, "visible_gpu_memory", lambda: [80 * GIB, 80 * GIB])
    assert gpu_shares(_flags(llm_gpus=0.5), model)[:2] == (1.0, 0.5)
    assert gpu_shares(_flags(encoder_gpus=0.3, llm_gpus=0.7), model) is None
    assert gpu_shares(_flags(device="cpu"), model) is None
    monkeypatch.setattr(shares_module, "visible_gpu_memory", lambda: [])
    assert gpu_shares(_flags(), model) is None
    args = app_args(_flags(), None, None)
    assert (args.encoder.num_gpus, args.llm.num_gpus) == (0, 0)


def test_a_tensor_parallel_size_the_gpus_cannot_hold_is_refused(tiny_models, monkeypatch):
    monkeypatch.setattr(shares_module, "visible_gpu_memory", lambda: [80 * GIB])
    with pytest.raises(RefusedToStart, match="--tensor-parallel-size 2 takes 2 whole GPUs"):
        gpu_shares(_flags(tensor_parallel_size=2), tiny_models["qwen2_vl"])


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    import subprocess

    listing = "0, GPU-aaa, 81559\n1, GPU-bbb, 81559\n2, GPU-ccc, 40960\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=listing))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert shares_module.visible_gpu_memory() == [81559 << 20, 81559 << 20, 40960 << 20]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-aaa")
    assert shares_module.visible_gpu_memory() == [81559 << 20, 40960 << 20]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert shares_module.visible_gpu_memory() == []
