"""Deployment configs stay valid and in sync: Serve YAML, RayService serveConfigV2, builder args."""

import json
from pathlib import Path

import yaml

from deployments.config import AppArgs

ROOT = Path(__file__).resolve().parents[2]


def _serve_config() -> dict:
    return yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())


def _rayservice() -> dict:
    return yaml.safe_load((ROOT / "k8s" / "base" / "rayservice.yaml").read_text())


def test_serve_config_validates_against_serve_schema_and_app_args():
    from ray.serve.schema import ServeDeploySchema

    config = _serve_config()
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.serve.app:build_app"
    AppArgs.model_validate(app["args"])


def test_rayservice_embeds_the_serve_config():
    assert yaml.safe_load(_rayservice()["spec"]["serveConfigV2"]) == _serve_config()


def gpu_overlay_serve_config(overlay: str = "gpu", patch: str = "gpu-workers.yaml") -> dict:
    """serveConfigV2 of the GPU (production) overlay."""
    patches = yaml.safe_load((ROOT / "k8s" / "overlays" / overlay / patch).read_text())
    return yaml.safe_load(next(p["value"] for p in patches if p["path"] == "/spec/serveConfigV2"))


def test_gpu_overlay_args_validate():
    from ray.serve.schema import ServeDeploySchema

    serve_config = gpu_overlay_serve_config()
    ServeDeploySchema.model_validate(serve_config)
    for app in serve_config["applications"]:
        args = AppArgs.model_validate(app["args"])
        assert args.encoder.num_gpus >= 1 and args.llm.num_gpus >= 1


def test_gpu_tp2_overlay_is_the_gpu_overlay_with_tensor_parallel_llm_replicas():
    """k8s/overlays/gpu-tp2 repeats the gpu overlay's serve config (a string: kustomize cannot patch
    inside it) and differs only in engine.tensor_parallel_size."""
    from ray.serve.schema import ServeDeploySchema

    tp2, gpu = gpu_overlay_serve_config("gpu-tp2", "tp2.yaml"), gpu_overlay_serve_config()
    ServeDeploySchema.model_validate(tp2)
    (app,) = tp2["applications"]
    assert AppArgs.model_validate(app["args"]).engine.tensor_parallel_size == 2
    engine = app["args"].pop("engine")
    assert engine.pop("tensor_parallel_size") == 2 and engine == gpu["applications"][0]["args"].pop("engine")
    assert tp2 == gpu


def test_grafana_dashboard_queries_only_exported_metrics():
    import re

    dashboard = json.loads((ROOT / "k8s" / "grafana" / "mmserve-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    queried = set(re.findall(r"ray_(mmserve_[a-z_]+?)(?:_bucket|_total)?\b", exprs))
    sources = [ROOT / "deployments" / "serve" / "metrics.py", ROOT / "deployments" / "serve" / "video_decoder.py"]  # video: its own, light
    exported = {name for path in sources for name in re.findall(r'"(mmserve_[a-z_]+)"', path.read_text())}
    assert queried and queried == exported  # every exported metric is charted, nothing else
    for metric in ("mmserve_encoder_queued_tokens", "mmserve_encoder_batch_fill_ratio", "mmserve_llm_kv_usage_ratio"):
        assert metric in queried


def test_standalone_encoder_address_needs_grpc_transport():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="needs transport: grpc"):
        AppArgs(grpc={"encoder_address": "encoder:50051"})
    assert AppArgs(transport="grpc", grpc={"encoder_address": "encoder:50051"}).grpc.encoder_address
    with pytest.raises(ValidationError, match="tls_ca applies to a standalone encoder"):
        AppArgs(transport="grpc", grpc={"tls_ca": "/ca.pem"})


def test_serve_config_fits_a_two_core_machine():
    """`serve run deployments/serve_config.yaml` must schedule every replica on a 2-core laptop."""
    args = AppArgs.model_validate(_serve_config()["applications"][0]["args"])
    total = sum(d.num_cpus * d.num_replicas for d in (args.router, args.encoder, args.llm, args.video_decoder))
    assert total <= 2
    defaults = AppArgs()
    deployments = (defaults.router, defaults.encoder, defaults.llm, defaults.video_decoder)
    assert sum(d.num_cpus * d.num_replicas for d in deployments) <= 2


def test_grafana_dashboard_filters_every_query_by_ray_cluster():
    """A blue/green upgrade runs two RayClusters: every series is selected by the $cluster variable."""
    import re

    dashboard = json.loads((ROOT / "k8s" / "grafana" / "mmserve-dashboard.json").read_text())
    assert "cluster" in {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for metric in re.findall(r"\bray_[a-z_]+(?:\{[^}]*\})?", target["expr"]):
                assert 'ray_io_cluster=~"$cluster"' in metric, (panel["title"], metric)
