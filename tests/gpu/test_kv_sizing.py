"""The KV pool of an LLM replica on part of a GPU: sized from its share (Ray's fractional
`num_gpus`), never from the whole device's free memory, so the encoder replica beside it keeps its
own part. The arithmetic, on CPU."""

import pytest
import torch

from deployments.config import AppArgs, EngineArgs
from deployments.serve.app import build_app
from llm_service.config import EngineConfig
from llm_service.model.kv_cache import cuda_kv_budget, pool_sizes

GIB = 2**30
TOTAL = 80 * GIB


def test_a_whole_device_keeps_the_old_rule():
    free = TOTAL - 3 * GIB - GIB // 2  # weights + CUDA context
    assert cuda_kv_budget(free, TOTAL, 3 * GIB, 0.9, 1.0) == int(free - TOTAL * 0.1)


def test_half_a_device_takes_its_half_whether_the_encoder_started_first_or_not():
    weights = 4 * GIB
    share = 0.5 * TOTAL * 0.9 - weights  # 32 GiB
    alone = TOTAL - weights - GIB  # the encoder replica has not allocated yet
    assert cuda_kv_budget(alone, TOTAL, weights, 0.9, 0.5) == int(share)
    assert cuda_kv_budget(alone, TOTAL, weights, 0.9, 1.0) > 2 * share  # the old rule took the encoder's half too
    beside_encoder = alone - 20 * GIB  # the encoder replica already holds 20 GiB of its 40
    assert cuda_kv_budget(beside_encoder, TOTAL, weights, 0.9, 0.5) == int(share)


def test_never_more_than_the_device_has_free_beyond_the_shares_headroom():
    weights = 4 * GIB
    free = 20 * GIB  # another process took more than its share
    assert cuda_kv_budget(free, TOTAL, weights, 0.9, 0.5) == int(free - 0.5 * TOTAL * 0.1)


def test_blocks_on_cuda_come_from_the_replicas_share(monkeypatch):
    weights = 4 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (TOTAL - weights - GIB, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: weights)
    block = 1 << 20
    half = pool_sizes(EngineConfig(device_share=0.5), block, 0, torch.device("cuda")).blocks
    assert half == int(0.5 * TOTAL * 0.9 - weights) // block
    explicit = EngineConfig(device_share=0.5, kv_cache_bytes=3 * GIB)  # kv_cache_memory_mb: taken as given
    assert pool_sizes(explicit, block, 0, torch.device("cuda")).blocks == 3 * GIB // block


@pytest.mark.parametrize("num_gpus, share", [(0.5, 0.5), (0.25, 0.25), (0, 1.0), (1, 1.0), (2, 1.0)])
def test_a_replicas_share_is_its_fraction_of_one_gpu(num_gpus, share):
    args = AppArgs(llm={"num_gpus": num_gpus})
    assert args.llm.device_share == share
    assert EngineArgs().resolve(args.llm.device_share).device_share == share


def test_the_app_hands_each_replica_its_share():
    app = build_app(AppArgs(encoder={"num_gpus": 0.3}, llm={"num_gpus": 0.7}))
    encoder, llm = (a._bound_deployment for a in app._bound_deployment.init_args[:2])
    args = llm.init_args[0]  # the LLM replica resolves its engine config from AppArgs on its node, as the encoder
    assert args.engine.resolve(args.llm.device_share).device_share == 0.7
    assert encoder.init_args[0].encoder.device_share == 0.3
    assert (encoder.ray_actor_options["num_gpus"], llm.ray_actor_options["num_gpus"]) == (0.3, 0.7)


def test_shares_outside_zero_to_one_are_refused():
    with pytest.raises(ValueError, match="device_share"):
        EngineConfig(device_share=0)
    with pytest.raises(ValueError, match="device_share"):
        EngineConfig(device_share=1.5)


def test_a_replica_on_part_of_a_gpu_is_held_to_its_part(monkeypatch):
    from mmserve.device import hold_to_share

    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: calls.append((f, device)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    hold_to_share("cuda", 0.5)
    hold_to_share("cuda:1", 0.25)
    hold_to_share("cuda", 1.0)  # a whole device: no cap
    hold_to_share("cpu", 0.5)
    # an index, as torch wants it: torch.device("cuda") raises "Expected a torch.device with a
    # specified index" there (every GPU replica on part of a device failed to start on an H200)
    assert calls == [(0.5, 0), (0.25, 1)]


def test_a_share_too_small_for_the_weights_fails_at_startup_with_what_to_change(monkeypatch):
    weights = 4 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (TOTAL - weights - GIB, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: weights)
    with pytest.raises(ValueError, match="num_gpus"):
        pool_sizes(EngineConfig(device_share=0.05), 1 << 20, 0, torch.device("cuda"))  # 3.6 GiB < the weights
