"""Autoscaling on queued work (not request counts): the encoder pool and the video decoders.

Each encoder replica reports `queued_tokens` (output tokens of the items it has admitted and not
yet answered) through Ray Serve's `record_autoscaling_stats`; `QueuedTokensPolicy` sizes the pool
to ceil(total queued tokens / target per replica). Each VideoDecoder replica reports
`queued_decode_s` (decode seconds running or waiting on it), and `QueuedWorkPolicy` sizes the
decoders the same way. Serve wraps the policy with the deployment's
`upscale_delay_s` / `downscale_delay_s` and scaling factors, and clamps to min/max replicas.

This module is pickled by value into the Serve controller: it imports nothing of the project.
"""

from __future__ import annotations

import math
from typing import Any

QUEUED_TOKENS = "queued_tokens"


QUEUED_DECODE_S = "queued_decode_s"


class QueuedWorkPolicy:
    """Custom Serve autoscaling policy: `__call__(ctx) -> (num_replicas, policy_state)`.

    `ctx.aggregated_metrics[metric]` maps each running replica to its queued work, averaged by
    Serve over `look_back_period_s`; the pool is sized to ceil(total / target per replica), clamped
    to the context's (capacity-adjusted) min/max replicas. Until a replica has reported, the
    current target stands.
    """

    def __init__(self, metric: str, target_per_replica: float):
        if not target_per_replica > 0:
            raise ValueError("the target per replica must be positive")
        self.metric = metric
        self.target_per_replica = float(target_per_replica)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        per_replica = (ctx.aggregated_metrics or {}).get(self.metric)
        queued = sum(per_replica.values()) if per_replica else None
        desired = ctx.target_num_replicas if queued is None else math.ceil(queued / self.target_per_replica)
        desired = max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, desired))
        return desired, dict(ctx.policy_state)


class QueuedTokensPolicy(QueuedWorkPolicy):
    """The encoder pool's: queued output tokens (`QUEUED_TOKENS`) per replica."""

    def __init__(self, target_tokens_per_replica: float):
        super().__init__(QUEUED_TOKENS, target_tokens_per_replica)


def scaled(scaling, options: dict, **target) -> dict:
    """A deployment's Serve `options` with autoscaling on queued work when `scaling.autoscale` is on
    (`scaling`: the deployment's `deployments.config` scaling settings; `target`: `autoscaling_config`'s
    target per replica)."""
    if not scaling.autoscale:
        return options
    options = {k: v for k, v in options.items() if k != "num_replicas"}
    settings = ("min_replicas", "max_replicas", "upscale_delay_s", "downscale_delay_s", "look_back_period_s",
                "metrics_interval_s")
    options["autoscaling_config"] = autoscaling_config(**{name: getattr(scaling, name) for name in settings}, **target)
    return options


def autoscaling_config(*, min_replicas: int, max_replicas: int, upscale_delay_s: float, downscale_delay_s: float,
                       look_back_period_s: float, metrics_interval_s: float,
                       target_tokens_per_replica: int | None = None, target_decode_s_per_replica: float | None = None
                       ) -> dict:
    """A Serve `autoscaling_config` (deployment option) running `QueuedTokensPolicy` (given
    `target_tokens_per_replica`) or `QueuedWorkPolicy` on queued decode seconds."""
    if target_tokens_per_replica is not None:
        policy = {"policy_function": f"{__name__}:{QueuedTokensPolicy.__name__}",
                  "policy_kwargs": {"target_tokens_per_replica": target_tokens_per_replica}}
    else:
        policy = {"policy_function": f"{__name__}:{QueuedWorkPolicy.__name__}",
                  "policy_kwargs": {"metric": QUEUED_DECODE_S, "target_per_replica": target_decode_s_per_replica}}
    # (metrics_interval_s: deprecated in Serve but still the replica's metrics push period in 2.60)
    return {"min_replicas": min_replicas, "initial_replicas": min_replicas, "max_replicas": max_replicas,
            "upscale_delay_s": upscale_delay_s, "downscale_delay_s": downscale_delay_s,
            "look_back_period_s": look_back_period_s, "metrics_interval_s": metrics_interval_s, "policy": policy}
