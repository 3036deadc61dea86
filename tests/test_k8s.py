"""Deployment configs stay valid and in sync: Serve YAML, RayService serveConfigV2, builder args."""

import json
from pathlib import Path

import yaml

from deployments.config import AppArgs

ROOT = Path(__file__).resolve().parent.parent


def _serve_config() -> dict:
    return yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())


def _rayservice() -> dict:
    return yaml.safe_load((ROOT / "k8s" / "base" / "rayservice.yaml").read_text())


def test_serve_config_validates_against_serve_schema_and_app_args():
    from ray.serve.schema import ServeDeploySchema

    config = _serve_config()
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    AppArgs.model_validate(app["args"])


def test_rayservice_embeds_the_serve_config_applications():
    embedded = yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])
    assert embedded["applications"] == _serve_config()["applications"]


def test_gpu_overlay_args_validate():
    patches = yaml.safe_load((ROOT / "k8s" / "overlays" / "gpu" / "gpu-workers.yaml").read_text())
    serve_config = next(p["value"] for p in patches if p["path"] == "/spec/serveConfigV2")
    for app in yaml.safe_load(serve_config)["applications"]:
        args = AppArgs.model_validate(app["args"])
        assert args.encoder.num_gpus >= 1 and args.llm.num_gpus >= 1


def test_grafana_dashboard_queries_exported_metrics():
    dashboard = json.loads((ROOT / "k8s" / "grafana" / "mmserve-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in ("mmserve_router_ttft_ms", "mmserve_encoder_items", "mmserve_llm_generated_tokens"):
        assert metric in exprs
