"""Executors: where an engine's workers run (uni: in its process; mp: a
process per rank; ray: a Ray actor per rank, across a cluster's nodes),
behind one interface."""

from __future__ import annotations

from pagoda.config import ParallelConfig
from pagoda.executor.abstract import Executor


# Here, not in abstract.py: the executors import abstract, so choosing among
# them there would be an import circle.
def get_executor_class(parallel_config: ParallelConfig) -> type[Executor]:
    backend = parallel_config.distributed_executor_backend
    if backend == "uni":
        from pagoda.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor
    if backend == "ray":
        from pagoda.executor.ray_executor import RayExecutor

        return RayExecutor
    from pagoda.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor
