"""The base of every settings model (`FrozenArgs`, `runtime_settings`: the settings a runtime
dataclass declares) and one Serve deployment's settings: its replicas, where they run,
autoscaling, its placement group (a tensor-parallel LLM replica's bundles).
`deployments.config.AppArgs` holds one per deployment."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from mmserve.settings import setting_name, type_hints

T = TypeVar("T")


class FrozenArgs(BaseModel):
    """Settings read once: unknown keys refused, never changed after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def build(args: BaseModel, runtime: type[T], **extra) -> T:
    """`runtime` made from the settings of `args` it declares (by their names in the app config)."""
    names = type(args).model_fields
    return runtime(**{f.name: getattr(args, setting_name(f)) for f in dataclasses.fields(runtime)
                      if setting_name(f) in names}, **extra)


def runtime_settings(*runtimes: type, base: type[BaseModel] = FrozenArgs) -> type[BaseModel]:
    """The base model of a section holding the settings `runtimes` declare (`mmserve.settings.setting`
    fields with a description): each under its name in the app config, with its type, default, bounds
    and description. Validation builds each runtime, so the rules its `__post_init__` checks (across
    fields too) refuse the app config, with their messages."""
    fields = {}
    for runtime in runtimes:
        for f in dataclasses.fields(runtime):
            if "description" in f.metadata:
                bounds = {k: v for k, v in f.metadata.items() if k != "name"}
                fields[setting_name(f)] = (type_hints(runtime)[f.name], Field(f.default, **bounds))

    def check_runtimes(args):
        for runtime in runtimes:
            build(args, runtime)
        return args

    model = create_model(f"{runtimes[0].__name__}Settings", __base__=base, __module__=__name__,
                         __validators__={"check_runtimes": model_validator(mode="after")(check_runtimes)}, **fields)
    model.runtimes = runtimes  # (tests/unit/test_structure.py: no section declares one of these again)
    return model


class ReplicaRange(FrozenArgs):
    """The replicas an autoscaled deployment may run."""

    min_replicas: int = Field(default=1, ge=0, description="fewest replicas")
    max_replicas: int = Field(default=4, ge=1, description="most replicas")

    @model_validator(mode="after")
    def _check_range(self) -> "ReplicaRange":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        return self


# Serve's queue bound per deployment when `max_queued_requests` is left out: as many as a replica
# runs at once (`max_ongoing_requests`). Serve queues every request a caller has not yet assigned to
# a replica, even with every replica idle (while it probes their queue lengths, while one restarts),
# so a bound below the concurrency the app serves sheds good requests under no overload (bench/soak.py
# lost one of 268 at concurrency 16 to the Router's old bound of 8). The app's own admission
# (`max_pending_requests`, the LLM's waiting tokens) is what sheds under load. The encoder is bounded
# by queued bytes instead: unbounded here.
UNBOUNDED_QUEUE = ("Encoder",)
RETRY_AFTER_S = 1
MIN_BUNDLE_CPUS = 0.01  # a placement group bundle's CPUs when its deployment asks for none


class ReplicaAutoscalingArgs(ReplicaRange):
    """Serve's default autoscaling policy: replicas follow the ongoing requests per replica."""

    target_ongoing_requests: float | None = Field(
        default=None, gt=0, description="per replica; default for the LLM: the engine's max_num_seqs"
    )
    upscale_delay_s: float = Field(default=30.0, ge=0, description="how long Serve must want more replicas to add one")
    downscale_delay_s: float = Field(default=600.0, ge=0, description="how long Serve must want fewer to remove one")


def serve_has(option: str) -> bool:
    """Whether this Serve's `serve.deployment` takes `option` (newer Serves add some)."""
    import inspect

    from ray import serve

    return option in inspect.signature(serve.deployment).parameters


class DeploymentArgs(FrozenArgs):
    """One deployment's replicas and where they may run.

    `label_selector`, `resources` and `accelerator_type` go to the replicas' Ray actor options:
    on KubeRay they pin a deployment to its worker group (the group's `labels` and `resources`),
    so encoder and LLM replicas never share, or land on, the wrong pods.
    """

    num_replicas: int = Field(default=1, ge=1, description="replicas (when not autoscaling)")
    num_cpus: float = Field(default=1.0, ge=0, description="CPUs per replica")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs per replica; below 1: that share of one GPU's "
                            "compute and memory")
    max_ongoing_requests: int = Field(default=64, ge=1, description="requests one replica handles at once")
    max_queued_requests: int | None = Field(
        default=None, ge=-1, description="requests queued for a replica (per caller) before Serve answers "
        "429 + Retry-After / RESOURCE_EXHAUSTED; -1: unbounded; default: max_ongoing_requests (Router, LLM), "
        "-1 for the Encoder (bounded by encoder_pool.max_queued_bytes)",
    )
    label_selector: dict[str, str] = Field(default_factory=dict, description="Ray node labels a replica needs")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per replica")
    accelerator_type: str | None = Field(default=None, description="e.g. H100, A100, L4 (Ray accelerator types)")
    autoscaling: ReplicaAutoscalingArgs | None = Field(
        default=None, description="autoscale on ongoing requests (num_replicas is then ignored)"
    )
    cpu_threads: int | None = Field(
        default=None, ge=1, description="torch intra-op threads of each replica that runs a model (Encoder, "
        "LLM); default: the node's cores (its CPU quota in a container) divided among this deployment's replicas "
        "at start, whatever their num_cpus (docs/operations.md). Set it where other work shares the node",
    )

    @property
    def device_share(self) -> float:
        """The fraction of one GPU a replica owns, memory included: `num_gpus` below 1 (two replicas
        at 0.5 share a device), else the whole device (`num_gpus` 0: none was asked for)."""
        return self.num_gpus if 0 < self.num_gpus < 1 else 1.0

    def placement(self, ranks: int) -> dict:
        """Serve's per-replica placement group for a replica of `ranks` processes (its own and one
        per other tensor-parallel rank, all on one node: STRICT_PACK). Serve pins the replica actor to
        bundle 0, which must hold the actor's resources (`ray_actor_options`); bundles 1.. are the rank
        workers' (`deployments.serve.tp_ranks`): as many CPUs as the replica, a whole GPU with `num_gpus` 1."""
        cpus = max(self.num_cpus, MIN_BUNDLE_CPUS)  # a bundle of zeros is refused by Ray
        gpu = {"GPU": self.num_gpus} if self.num_gpus else {}
        accelerator = {f"accelerator_type:{self.accelerator_type}": 0.001} if self.accelerator_type else {}
        first = {"CPU": cpus, **gpu, **self.resources, **accelerator}
        options = {"placement_group_bundles": [first] + [{"CPU": cpus, **gpu, **accelerator}] * (ranks - 1),
                   "placement_group_strategy": "STRICT_PACK"}
        if self.label_selector and serve_has("placement_group_bundle_label_selector"):
            options["placement_group_bundle_label_selector"] = [dict(self.label_selector)]  # Serve: every bundle
        return options

    def options(self, name: str, default_target_ongoing_requests: float | None = None, ranks: int = 1) -> dict:
        """Serve's deployment options; `ranks` > 1: each replica with its placement group (`placement`)."""
        placed = self.model_dump(include={"label_selector", "resources", "accelerator_type"})
        actor = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, **{k: v for k, v in placed.items() if v}}
        queued = self.max_queued_requests
        if queued is None:
            queued = -1 if name in UNBOUNDED_QUEUE else self.max_ongoing_requests
        options = {"name": name, "max_ongoing_requests": self.max_ongoing_requests, "max_queued_requests": queued,
                   "ray_actor_options": actor}
        if ranks > 1:
            options.update(self.placement(ranks))
        if serve_has("backpressure_config"):  # Serve >= 2.5x; older ones answer 503 without Retry-After
            options["backpressure_config"] = {"status_code": 429, "retry_after_s": RETRY_AFTER_S}
        if self.autoscaling is None:
            options["num_replicas"] = self.num_replicas
            return options
        target = self.autoscaling.target_ongoing_requests or default_target_ongoing_requests
        options["autoscaling_config"] = {**self.autoscaling.model_dump(exclude={"target_ongoing_requests"}),
                                         **({"target_ongoing_requests": target} if target else {})}
        return options
