"""`engine.tensor_parallel_size` in the app's arguments: what goes with it and what is refused (a
validation error naming the fields), the LLM deployment's placement group (a bundle per rank,
STRICT_PACK, the replica actor inside bundle 0), the engine setting resolved, and
`mmserve serve --tensor-parallel-size`."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from deployments.cli.local_serve import RefusedToStart, app_args
from deployments.config import AppArgs
from deployments.deployment_args import MIN_BUNDLE_CPUS, DeploymentArgs
from deployments.serve.app import build_app


def _deployments(app) -> dict:
    """name -> the bound Serve deployment, over the application's graph."""
    found, todo = {}, [app._bound_deployment]
    while todo:
        d = todo.pop()
        found[d.name] = d
        todo += [a._bound_deployment for a in (*d.init_args, *d.init_kwargs.values()) if hasattr(a, "_bound_deployment")]
    return found


def _llm(args: dict):
    return _deployments(build_app(args))["LLM"]


@pytest.mark.parametrize("extra,fields", [
    ({"colocated": True}, ("colocated",)),
    ({"llm": {"num_gpus": 0.5}}, ("llm.num_gpus 0.5",)),
    ({"llm": {"num_gpus": 2}}, ("llm.num_gpus 2",)),
    ({"engine": {"async_scheduling": True}}, ("engine.async_scheduling",)),
])
def test_tensor_parallel_refuses_what_cannot_be_split(extra, fields):
    engine = {"tensor_parallel_size": 2, **extra.pop("engine", {})}
    with pytest.raises(ValidationError) as e:
        AppArgs.model_validate({**extra, "engine": engine})
    assert "engine.tensor_parallel_size 2" in str(e.value)
    for field in fields:
        assert field in str(e.value)
    AppArgs.model_validate({**extra, "engine": {**engine, "tensor_parallel_size": 1}})  # fine without it


def test_tensor_parallel_size_is_validated_and_resolved():
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        AppArgs.model_validate({"engine": {"tensor_parallel_size": 0}})
    args = AppArgs.model_validate({"engine": {"tensor_parallel_size": 4}, "llm": {"num_gpus": 1}})
    config = args.engine.resolve(args.llm.device_share)
    assert config.tensor_parallel_size == 4 and config.device_share == 1.0 and not config.async_scheduling
    assert AppArgs().engine.resolve(1.0).tensor_parallel_size == 1


def test_cpu_placement_group_a_bundle_per_rank():
    llm = _llm({"engine": {"tensor_parallel_size": 2}, "llm": {"num_cpus": 0.5}})
    config = llm._replica_config
    assert config.placement_group_bundles == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert config.placement_group_strategy == "STRICT_PACK"
    assert llm.ray_actor_options["num_cpus"] == 0.5 and not llm.ray_actor_options["num_gpus"]
    # a deployment that asks for no CPU still gets bundles Ray accepts (never all zeros)
    bundles = _llm({"engine": {"tensor_parallel_size": 3}, "llm": {"num_cpus": 0}})._replica_config.placement_group_bundles
    assert bundles == [{"CPU": MIN_BUNDLE_CPUS}] * 3


def test_gpu_placement_group_one_gpu_per_rank_and_the_replica_in_bundle_0():
    llm = _llm({"engine": {"tensor_parallel_size": 4},
                "llm": {"num_cpus": 2, "num_gpus": 1, "accelerator_type": "H100", "resources": {"llm_pool": 1}}})
    config = llm._replica_config
    accel = {"accelerator_type:H100": 0.001}
    assert config.placement_group_bundles == [{"CPU": 2, "GPU": 1, "llm_pool": 1, **accel}] + [
        {"CPU": 2, "GPU": 1, **accel}] * 3
    assert config.placement_group_strategy == "STRICT_PACK"
    actor = llm.ray_actor_options
    assert (actor["num_cpus"], actor["num_gpus"], actor["resources"]) == (2, 1, {"llm_pool": 1})


def test_label_selector_applies_to_every_bundle():
    options = DeploymentArgs(num_cpus=1, num_gpus=1, label_selector={"pool": "llm"}).options("LLM", ranks=2)
    assert options["ray_actor_options"]["label_selector"] == {"pool": "llm"}
    if "placement_group_bundle_label_selector" in options:  # this Serve takes one
        assert options["placement_group_bundle_label_selector"] == [{"pool": "llm"}]


def test_one_rank_has_no_placement_group():
    config = _llm({})._replica_config
    assert config.placement_group_bundles is None and config.placement_group_strategy is None
    for name, deployment in _deployments(build_app({"engine": {"tensor_parallel_size": 2}})).items():
        if name != "LLM":
            assert deployment._replica_config.placement_group_bundles is None, name


def _serve_flags(**flags) -> argparse.Namespace:
    base = dict(model=None, dtype="auto", device="auto", num_cpus=2, encoder_gpus=0, llm_gpus=0,
                max_model_len=None, tensor_parallel_size=1, lora=[])
    return argparse.Namespace(**{**base, **flags})


def test_serve_command_flag():
    from deployments.cli.main import main

    with pytest.raises(SystemExit):  # the parser takes positive integers only
        main(["serve", "--tensor-parallel-size", "0"])
    args = app_args(_serve_flags(tensor_parallel_size=2), None)
    assert args.engine.tensor_parallel_size == 2
    assert args.llm.num_cpus == 0.25  # the LLM's quarter of --num-cpus, shared by its two ranks
    assert app_args(_serve_flags(), None).llm.num_cpus == 0.5
    with pytest.raises(RefusedToStart, match="--tensor-parallel-size 2 with --llm-gpus 0.5"):
        app_args(_serve_flags(tensor_parallel_size=2, llm_gpus=0.5), None)
