"""The planner's analytic first answer: a split's capacity (requests/s) from the profile's service
times and the workload's mean request at full batches, before any simulation: where
`mmserve.capacity.goodput.recommend` starts each goodput search, and what rules a split out. An
optimistic bound, not a prediction (docs/capacity.md#the-search-seconds-by-default---full-for-every-split)."""

from __future__ import annotations

from mmserve.capacity.inputs import Profile, Workload


def _images(workload: Workload) -> float:
    return sum(workload.images) / 2


def encoder_seconds(profile: Profile, workload: Workload) -> float:
    """An encoder's busy time per request at capacity: its images' tokens, less the cache's hits."""
    return _images(workload) * (1 - workload.repeat_share) * workload.mean_image_tokens * profile.encode_token_s


def llm_seconds(profile: Profile, workload: Workload) -> float:
    """An LLM replica's busy time per request at capacity: its prompt's prefill, its decodes, and
    its share of the steps (a step prefills `max_batched_tokens` and decodes up to `max_num_seqs`
    sequences, or as many as the KV cache holds)."""
    prompt = workload.text_tokens + _images(workload) * workload.mean_image_tokens
    output = workload.output_tokens
    sequences = profile.max_num_seqs
    if profile.kv_tokens is not None:
        sequences = max(1.0, min(sequences, profile.kv_tokens / (prompt + output)))
    steps = max(prompt / profile.max_batched_tokens, output / sequences)
    return prompt * profile.prefill_token_s + (output - 1) * profile.decode_seq_s + steps * profile.step_s


def capacity(profile: Profile, workload: Workload, num_encoders: int, num_llms: int) -> float:
    """Requests/s a split can serve at most, as the mean request's work says; `num_encoders=0` is
    colocated (each LLM replica's device does its requests' encoding too). On a shared box
    (`Profile.shared_capacity`) every replica's work and the router's share its cores."""
    encode, step = encoder_seconds(profile, workload), llm_seconds(profile, workload)
    bound = (min(num_encoders / encode if encode else float("inf"), num_llms / step) if num_encoders
             else num_llms / (encode + step))
    if profile.shared_capacity:
        bound = min(bound, profile.shared_capacity / (profile.router_s + encode + step))
    return bound
