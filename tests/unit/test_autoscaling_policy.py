"""The encoder pool's autoscaling policy on synthetic Serve autoscaling contexts."""

import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.serve.autoscaling import QUEUED_TOKENS, QueuedTokensPolicy, autoscaling_config
from mmserve.families.qwen2_vl import VisionPreprocessConfig, image_grid, tokens_for_grid

QWEN = VisionPreprocessConfig()  # the real Qwen2-VL processor sizing
TARGET = 8192


def tokens(height: int, width: int) -> int:
    return tokens_for_grid(image_grid(height, width, QWEN), QWEN.merge_size)


def context(queued_per_replica: list[float] | None, num_requests: float, current=1, min_r=1, max_r=8) -> AutoscalingContext:
    replicas = [f"replica-{i}" for i in range(current)]
    metrics = None if queued_per_replica is None else {QUEUED_TOKENS: dict(zip(replicas, queued_per_replica))}
    return AutoscalingContext(
        deployment_id=None, deployment_name="Encoder", app_name="mmserve",
        current_num_replicas=current, target_num_replicas=current, running_replicas=replicas,
        total_num_requests=num_requests, total_queued_requests=0.0,
        aggregated_metrics=metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=min_r, capacity_adjusted_max_replicas=max_r,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=None,
    )


def test_few_requests_with_huge_images_scale_up():
    per_image = tokens(4000, 3000)  # a 12-megapixel photo: the processor's max_pixels cap
    assert per_image > 1000
    replicas, _ = QueuedTokensPolicy(TARGET)(context([20 * per_image], num_requests=20))
    assert replicas == -(-20 * per_image // TARGET) >= 3


def test_it_follows_tokens_not_request_counts():
    policy = QueuedTokensPolicy(TARGET)
    huge = 8 * tokens(4000, 3000)  # 8 requests
    tiny = 400 * tokens(64, 64)  # 400 requests with thumbnails
    up, _ = policy(context([huge], num_requests=8))
    flat, _ = policy(context([tiny], num_requests=400))
    assert huge > TARGET > tiny
    assert up == -(-huge // TARGET) > 1
    assert flat == 1


def test_sums_queued_tokens_over_replicas():
    replicas, _ = QueuedTokensPolicy(1000)(context([900, 900, 900], num_requests=3, current=3))
    assert replicas == 3
    replicas, _ = QueuedTokensPolicy(1000)(context([100, 0, 50], num_requests=1, current=3))
    assert replicas == 1


@pytest.mark.parametrize("queued, expected", [(0, 2), (10**9, 5)])
def test_min_and_max_replicas_are_respected(queued, expected):
    replicas, _ = QueuedTokensPolicy(1000)(context([queued], num_requests=1, min_r=2, max_r=5))
    assert replicas == expected


def test_no_reports_yet_keeps_the_current_target():
    assert QueuedTokensPolicy(1000)(context(None, num_requests=50, current=3))[0] == 3


def test_config_round_trips_through_serve():
    cfg = AutoscalingConfig(**autoscaling_config(
        min_replicas=1, max_replicas=3, target_tokens_per_replica=4096, upscale_delay_s=1,
        downscale_delay_s=2, look_back_period_s=5, metrics_interval_s=1,
    ))
    policy_cls = cfg.policy.get_policy()
    assert policy_cls.__name__ == "QueuedTokensPolicy" and cfg.policy.policy_kwargs == {"target_tokens_per_replica": 4096}
    assert policy_cls(**cfg.policy.policy_kwargs)(context([9000], num_requests=1, max_r=3))[0] == 3


def test_video_decoder_config_runs_the_queued_work_policy_on_decode_seconds():
    from deployments.serve.autoscaling import QUEUED_DECODE_S

    cfg = AutoscalingConfig(**autoscaling_config(
        min_replicas=1, max_replicas=4, target_decode_s_per_replica=4.0, upscale_delay_s=1,
        downscale_delay_s=2, look_back_period_s=5, metrics_interval_s=1,
    ))
    policy = cfg.policy.get_policy()(**cfg.policy.policy_kwargs)
    assert cfg.policy.policy_kwargs == {"metric": QUEUED_DECODE_S, "target_per_replica": 4.0}
    ctx = context([9.0, 4.5], num_requests=2, current=2, max_r=4)
    ctx.aggregated_metrics = {QUEUED_DECODE_S: ctx.aggregated_metrics[QUEUED_TOKENS]}
    assert policy(ctx)[0] == 4  # 13.5 decode seconds queued / 4 per replica
