"""The other ranks of a tensor-parallel LLM replica: one Ray actor per rank, in the replica's own
placement group (`DeploymentArgs.placement`: bundle 0 is the replica's, bundle i rank i's, all on
one node), each running `llm_service.model.model_runner.rank_main` until rank 0 (the replica, through
its engine) stops the group.

The replica and its ranks live and die together. A rank that ends (killed, crashed, its node
gone) breaks the group: rank 0's next collective raises (gloo: the peer closed its connection) and
the engine fails its requests with `ReplicaLost` (the router resubmits them) and reports itself
unhealthy; a rank that hangs stalls the engine (`engine.stall_timeout_s`, then Serve's health
check). `RankWorkers.watch` also ends the replica's process as soon as Ray reports a rank's end:
its requests fail over as from any lost replica (the router resumes the streams), and no request
routed to it meanwhile is spent on a replica that can serve no more (Serve's health check comes
every few seconds); `check_health` fails too (`RankWorkers.dead`). The rank actors are owned by
the replica: Ray ends them with it, and `RankWorkers.close` kills them on a graceful shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

import ray

logger = logging.getLogger("ray.serve")  # the replica's lines
RANK_ACTOR_PREFIX = "mmserve_tp_rank::"
RENDEZVOUS_HOST = "127.0.0.1"  # the group's store: its ranks share a node (STRICT_PACK)
rank_logger = logging.getLogger(__name__)  # a rank actor's lines: its format names the rank (`TPRank`)


def rank_actor_name(replica: str, rank: int) -> str:
    """The Ray actor name of rank `rank` of replica `replica` (Serve's replica id), in the replica's
    namespace: the dashboard lists a replica's ranks by it, tests find them."""
    return f"{RANK_ACTOR_PREFIX}{replica}::{rank}"


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the group's rendezvous: rank 0 listens there)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@ray.remote(max_restarts=0, max_task_retries=0)
class TPRank:
    """Rank `rank` (>= 1) of a replica's tensor-parallel group of `size`."""

    def __init__(self, rank: int, size: int, replica: str):
        self.rank, self.size, self.replica = rank, size, replica
        logging.basicConfig(level=logging.INFO, force=True, format=f"%(asctime)s %(levelname)s tensor-parallel rank "
                            f"{rank}/{size} of replica {replica}: %(name)s: %(message)s")

    def __repr__(self) -> str:  # Ray prefixes this process's log lines with it
        return f"TPRank(rank={self.rank}/{self.size}, replica={self.replica})"

    def run(self, init_method: str, model: str | None, device: str, dtype: str, config, threads: int,
            timeout_s: float) -> dict:
        """Resolves the model and the device on this node as the replica does, then follows rank 0's
        steps (blocking) until it stops the group; returns the rank's collective counts."""
        import torch

        from deployments.replica_env import resolve_model_dir
        from llm_service.model.model_runner import rank_main
        from mmserve.device import resolve_device

        model_dir, device = resolve_model_dir(model), resolve_device(device)
        torch.set_num_threads(threads)
        rank_logger.info("%s on %s, %d torch threads, joining %s", model_dir, device, threads, init_method)
        try:
            counts = rank_main(self.rank, self.size, init_method, model_dir, dtype, device, config,
                               timeout_s=timeout_s)
        except BaseException:
            rank_logger.exception("failed")
            raise
        rank_logger.info("stopped by rank 0: %s", counts)
        return counts


class RankWorkers:
    """The `size - 1` other ranks of the calling replica (its placement group's bundles 1..), started
    at once; the group's `init_method` on loopback: every rank is on this node (the placement group is
    STRICT_PACK), and rank 0's store listens on that address alone (`llm_service.model.tensor_parallel`)."""

    def __init__(self, size: int, replica: str, model: str | None, device: str, dtype: str, config, threads: int,
                 timeout_s: float):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        if pg is None or len(pg.bundle_specs) < size:
            raise RuntimeError(f"engine.tensor_parallel_size {size}: this replica has no placement group of {size} "
                               "bundles (the app builder gives the LLM deployment one: build it with "
                               "deployments.serve.app:build_app)")
        self.init_method = f"tcp://{RENDEZVOUS_HOST}:{free_port(RENDEZVOUS_HOST)}"
        self.size, self.replica = size, replica
        self.actors, self.refs = [], []
        self.stopping = False  # set once the group is stopped on purpose (`closing`)
        for rank in range(1, size):
            bundle = pg.bundle_specs[rank]
            actor = TPRank.options(
                name=rank_actor_name(replica, rank), num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(rank, size, replica)
            self.actors.append(actor)
            self.refs.append(actor.run.remote(self.init_method, model, device, dtype, config, threads, timeout_s))
        logger.info("LLM replica %s: tensor-parallel ranks 1..%d started (group %s)", replica, size - 1,
                    self.init_method)

    def dead(self, timeout_s: float = 0) -> str | None:
        """Why a rank has ended (each rank runs until the group stops), or None while all run;
        waits up to `timeout_s` for one to end."""
        ready, _ = ray.wait(self.refs, num_returns=1, timeout=timeout_s)
        if not ready:
            return None
        rank = self.refs.index(ready[0]) + 1
        try:
            result = ray.get(ready[0], timeout=5)
            return f"tensor-parallel rank {rank} of {self.size} ended ({result})"
        except Exception as e:
            return f"tensor-parallel rank {rank} of {self.size} died: {type(e).__name__}: {str(e)[:300]}"

    def watch(self, on_death=None) -> threading.Thread:
        """A daemon thread that, once a rank ends outside `close`, logs why and ends this process
        (`on_death(reason)` instead, for tests): the replica fails as a whole, its requests fail over."""
        def run():
            while not self.stopping:
                reason = self.dead(timeout_s=1.0)
                if reason is None or self.stopping:
                    continue
                logger.error("LLM replica %s: %s; ending the replica (its requests fail over, Serve replaces it)",
                             self.replica, reason)
                if on_death is not None:
                    on_death(reason)
                    return
                self.kill()
                for handler in logging.getLogger().handlers + logger.handlers:
                    handler.flush()
                time.sleep(0.1)
                os._exit(1)

        thread = threading.Thread(target=run, name="tp-rank-watch", daemon=True)
        thread.start()
        return thread

    def closing(self) -> None:
        """The group is being stopped on purpose: a rank that ends now ends nothing else."""
        self.stopping = True

    def kill(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)

    def close(self, timeout_s: float = 10.0) -> None:
        """After the engine stopped the group: wait for the ranks to return, then end their actors."""
        self.stopping = True
        ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        self.kill()
