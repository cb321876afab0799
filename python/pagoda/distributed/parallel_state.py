"""The process group and the tensor-parallel group of this worker process.

A worker of a TP=N engine runs, before building its model:

    init_distributed_environment(N, rank, "tcp://127.0.0.1:PORT", "nccl")  # "gloo" on the CPU
    initialize_model_parallel(N)

Layers read the TP world size and rank when they are constructed, so a model
built before initialize_model_parallel() (or without it, on one device) is an
unsharded model that never calls a collective.
"""

from __future__ import annotations

import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_TP_WORLD_SIZE = 1
_TP_RANK = 0


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str, backend: str) -> None:
    """Joins the process group of all workers (backend "nccl" for CUDA
    tensors, "gloo" for CPU ones). A CUDA worker selects its device first
    (torch.cuda.set_device), so that NCCL binds the right GPU."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    dist.init_process_group(backend, init_method=distributed_init_method, world_size=world_size, rank=rank)


def initialize_model_parallel(tensor_parallel_size: int) -> None:
    """Creates the TP group: every rank of the world (tensor parallelism is
    the only parallelism)."""
    global _TP_GROUP, _TP_WORLD_SIZE, _TP_RANK
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed_environment(...) before initialize_model_parallel(...)")
    if _TP_GROUP is not None:
        raise RuntimeError("the tensor-parallel group is already initialized")
    world_size = dist.get_world_size()
    if tensor_parallel_size != world_size:
        raise ValueError(
            f"tensor_parallel_size ({tensor_parallel_size}) must equal the world size ({world_size}): "
            "tensor parallelism is the only parallelism"
        )
    _TP_GROUP = dist.new_group(list(range(world_size)))
    _TP_WORLD_SIZE, _TP_RANK = world_size, dist.get_rank()


def model_parallel_is_initialized() -> bool:
    return _TP_GROUP is not None


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    if _TP_GROUP is None:
        raise RuntimeError("the tensor-parallel group is not initialized")
    return _TP_GROUP


def get_tensor_model_parallel_world_size() -> int:
    return _TP_WORLD_SIZE


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def destroy_model_parallel() -> None:
    """Destroys the TP group and the process group; a no-op for whichever of
    them does not exist."""
    global _TP_GROUP, _TP_WORLD_SIZE, _TP_RANK
    if _TP_GROUP is not None:
        dist.destroy_process_group(_TP_GROUP)
    _TP_GROUP, _TP_WORLD_SIZE, _TP_RANK = None, 1, 0
    if dist.is_initialized():
        dist.destroy_process_group()
