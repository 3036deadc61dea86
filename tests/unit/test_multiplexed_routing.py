"""The affinity router's ranks under Serve's model multiplexing (a LoRA adapter is the request's
multiplexed model id): the replicas holding the adapter first, the affinity choice among them
alone first, then the others (`deployments.serve.affinity_routing`)."""

from deployments.serve.affinity_routing import multiplexed_holders, ranks

LOADED = {"r1": {"a"}, "r2": {"a", "b"}, "r3": set()}


def test_the_holders_of_the_adapter_are_the_candidates():
    assert multiplexed_holders("a", LOADED) == ["r1", "r2"]
    assert multiplexed_holders("b", LOADED) == ["r2"]
    assert multiplexed_holders("c", LOADED) == [] and multiplexed_holders("", LOADED) == []


def test_ranks_put_the_choice_then_the_other_holders_then_the_rest():
    ids = sorted(LOADED)
    assert ranks("r2", ["r1", "r2"], ids) == [["r2"], ["r1"], ["r3"]]
    assert ranks("r2", ["r2"], ids) == [["r2"], ["r1", "r3"]]
    assert ranks("r3", [], ids) == [["r3"], ["r1", "r2"]]  # no holder (or no adapter): choice, then the rest
