"""The Ray executor: one Ray actor per tensor-parallel rank, each a Worker on
its own device, placed by a placement group (one bundle per rank: a GPU, or
a CPU on the CPU), so the ranks may sit on several nodes of a Ray cluster.
They join torch.distributed (NCCL on GPUs, gloo on the CPU) at an address
and port the engine picks on rank 0's node.

The cluster: the one RAY_ADDRESS names (host:port, or "auto" for the one
`ray start` began on this machine), else a local one the executor starts (and
stops at shutdown).
A Ray session the caller opened (ray.init) is used as it is and left open.

Each step the scheduler output is put into Ray's object store once and every
rank's actor is called with it; the ranks follow the step protocol of
pagoda.executor.ranks (an actor's calls run one at a time, in the order
sent). The engine waits on every rank's reply: an actor that dies or raises
fails the step in wait at once with WorkerDiedError (its rank and reason),
never a hang on a peer blocked in a collective. Shutdown kills the actors and
removes the placement group; the actors also die with the engine's process
(Ray ends the actors a driver owns).
"""

from __future__ import annotations

import atexit
import collections
import os
import time

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagoda.executor.ranks import RankedExecutor, RankSteps, WorkerDiedError, free_port, start_worker
from pagoda.logger import init_logger
from pagoda.outputs import ModelRunnerOutput
from pagoda.process_watch import raise_startup_error

logger = init_logger(__name__)

PLACEMENT_TIMEOUT_S = 300.0  # for busy resources of the cluster to come free
PEER_GRACE_S = 2.0  # how long a rank's error waits for a peer's death that explains it


@ray.remote
class RayRank:
    """One rank: its worker and its side of the step protocol."""

    def __init__(self):
        self.steps: RankSteps | None = None

    def where(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        return free_port("")  # every interface: ranks on other nodes connect to it

    def start(self, rank: int, world_size: int, init_method: str, model_config, cache_config, scheduler_config,
              eos_token_ids: list[int]) -> int:
        # Ray shows an actor only the GPU of its bundle: it is cuda:0 there.
        worker = start_worker(rank, world_size, init_method, model_config, cache_config, scheduler_config,
                              eos_token_ids, device_index=0)
        self.steps = RankSteps(rank, worker)
        return worker.num_blocks

    def execute(self, scheduled) -> ModelRunnerOutput | None:
        return self.steps.execute(scheduled)

    def flush(self) -> ModelRunnerOutput | None:
        return self.steps.flush()


def _connect(world_size: int) -> None:
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        # Not ray.init()'s own search for a cluster `ray start` began here: a
        # stale record of one that is gone makes it retry for minutes.
        # On the CPU every rank takes a core's bundle: the ranks may outnumber the cores.
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False)


class RayExecutor(RankedExecutor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        world_size = self.parallel_config.world_size
        self.actors: list = []
        self.where: list[tuple[str, int]] = []  # each rank's node address and pid
        self.placement_group = None
        self._calls: collections.deque[list[ray.ObjectRef]] = collections.deque()  # each call's replies, in order
        self._owns_ray = not ray.is_initialized()  # ours to shut down
        started = time.perf_counter()
        try:
            if self._owns_ray:
                _connect(world_size)
            self._place(world_size)
            blocks = self._start(world_size)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(blocks)  # ranks size their caches alike; the scheduler uses what every one holds
        atexit.register(self.shutdown)  # an offline LLM that is never shut down still stops its actors
        logger.info("%d Ray worker(s) ready in %.1f s (%s)", world_size, time.perf_counter() - started,
                    ", ".join(f"rank {r}: pid {pid} on {ip}" for r, (ip, pid) in enumerate(self.where)))

    def _place(self, world_size: int) -> None:
        """One actor per bundle of a placement group: rank 0 on this node
        where a bundle landed here, and each node's ranks consecutive."""
        bundle = {"GPU": 1} if self.model_config.device.type == "cuda" else {"CPU": 1}
        (resource, amount), = bundle.items()
        total = ray.cluster_resources().get(resource, 0)
        if total < amount * world_size:
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} {resource}(s) in the Ray cluster, "
                             f"which has {total:g}")
        self.placement_group = placement_group([bundle] * world_size, strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise WorkerDiedError(f"the Ray cluster did not free {world_size} {resource}(s) for the ranks within "
                                  f"{PLACEMENT_TIMEOUT_S:g} s (available now: {ray.available_resources()})")
        options = {"num_gpus": 1, "num_cpus": 0} if resource == "GPU" else {"num_cpus": 1}
        actors = [
            RayRank.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=index)).remote()
            for index in range(world_size)
        ]
        self.actors = actors  # shutdown kills them if what follows fails
        where = self._gather([actor.where.remote() for actor in actors])
        here = ray.util.get_node_ip_address()
        order = sorted(range(world_size), key=lambda i: (where[i][0] != here, where[i][0]))
        self.actors, self.where = [actors[i] for i in order], [where[i] for i in order]

    def _start(self, world_size: int) -> list[int]:
        init_method = f"tcp://{self.where[0][0]}:{ray.get(self.actors[0].free_port.remote())}"
        return self._gather(
            [actor.start.remote(rank, world_size, init_method, self.model_config, self.cache_config,
                                self.scheduler_config, self.eos_token_ids)
             for rank, actor in enumerate(self.actors)],
            starting=True,
        )

    def _gather(self, refs: list[ray.ObjectRef], starting: bool = False) -> list:
        """Every rank's reply to one call (refs in rank order), as each comes:
        the first rank that died or raised raises (WorkerDiedError; while
        starting, its ValueError or OSError as such)."""
        values = [None] * len(refs)
        waiting = {ref: rank for rank, ref in enumerate(refs)}
        while waiting:
            ready, _ = ray.wait(list(waiting), num_returns=1)
            rank = waiting.pop(ready[0])
            try:
                values[rank] = ray.get(ready[0])
            except RayError as exc:
                rank, exc = self._first_death(rank, exc, waiting)
                if starting and not isinstance(exc, RayActorError):
                    cause = getattr(exc, "cause", exc)
                    raise_startup_error(type(cause).__name__, str(cause), WorkerDiedError, f"worker rank {rank}")
                raise WorkerDiedError(self._describe(rank, exc)) from None
        return values

    @staticmethod
    def _first_death(rank: int, exc: RayError, waiting: dict) -> tuple[int, RayError]:
        """A rank that lost a peer fails too: the peer that died, if one
        did within PEER_GRACE_S, is the one to name."""
        if isinstance(exc, RayActorError) or not waiting:
            return rank, exc
        done, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=PEER_GRACE_S)
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError as died:
                return waiting[ref], died
            except RayError:
                pass
        return rank, exc

    def _describe(self, rank: int, exc: RayError) -> str:
        if isinstance(exc, RayActorError):
            ip, pid = self.where[rank] if rank < len(self.where) else ("?", "?")
            reason = str(exc).strip().splitlines()[0]
            return f"worker rank {rank} (Ray actor, pid {pid} on {ip}) died: {reason}"
        cause = getattr(exc, "cause", exc)
        return f"worker rank {rank} failed: {type(cause).__name__}: {cause}"

    def _send(self, message: tuple) -> None:
        args = [ray.put(message[1])] if len(message) > 1 else []  # serialized once for every rank
        self._calls.append([getattr(actor, message[0]).remote(*args) for actor in self.actors])

    def _next_output(self) -> ModelRunnerOutput:
        while True:  # a call that found no pending step (the first) brings no result
            output = self._gather(self._calls.popleft())[0]
            if output is not None:
                return output

    def shutdown(self) -> None:
        if ray.is_initialized():
            for actor in self.actors:
                ray.kill(actor)
            if self.placement_group is not None:
                remove_placement_group(self.placement_group)
            if self._owns_ray:
                ray.shutdown()
        self.actors, self.placement_group, self._owns_ray = [], None, False
        self._calls.clear()
        atexit.unregister(self.shutdown)
