"""Application arguments: validated once here (pydantic), resolved into frozen runtime settings."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mmserve.planner import MediaLimits


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeploymentArgs(_Args):
    num_replicas: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    max_ongoing_requests: int = Field(default=64, ge=1)

    def options(self, name: str) -> dict:
        return {
            "name": name,
            "num_replicas": self.num_replicas,
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
        }


class LimitArgs(_Args):
    max_items_per_request: int = Field(default=16, ge=0)
    max_frames_per_video: int = Field(default=64, ge=1)
    max_pixels_per_image: int = Field(default=40_000_000, ge=1)
    max_request_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    allow_local_media: bool = True
    allow_http_media: bool = False
    http_media_allowlist: tuple[str, ...] = ()

    def media_limits(self) -> MediaLimits:
        return MediaLimits(self.max_items_per_request, self.max_frames_per_video, self.max_pixels_per_image)


class AppArgs(_Args):
    """Arguments of `deployments.app:build_app` (the `args:` of a Serve config YAML)."""

    model: str | None = Field(default=None, description="checkpoint directory; default: the embedded tiny model")
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    transport: Literal["object_store"] = "object_store"
    api_key: str | None = None
    router: DeploymentArgs = DeploymentArgs(num_cpus=0.5)
    encoder: DeploymentArgs = DeploymentArgs()
    llm: DeploymentArgs = DeploymentArgs()
    limits: LimitArgs = LimitArgs()
