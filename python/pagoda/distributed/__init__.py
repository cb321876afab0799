"""Tensor parallelism over torch.distributed: the process group and the TP
group (parallel_state), the collectives the model layers call
(communication_op), and the divisibility rule a model must meet (utils).

Nothing here is needed on one device: until initialize_model_parallel() runs,
the TP world size is 1, the rank 0, and the collectives return their input.
The names load lazily so that `pagoda.distributed.utils` (stdlib only) can be
imported where torch is not.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "init_distributed_environment": "parallel_state",
    "initialize_model_parallel": "parallel_state",
    "destroy_model_parallel": "parallel_state",
    "model_parallel_is_initialized": "parallel_state",
    "get_tensor_model_parallel_group": "parallel_state",
    "get_tensor_model_parallel_world_size": "parallel_state",
    "get_tensor_model_parallel_rank": "parallel_state",
    "tensor_model_parallel_all_reduce": "communication_op",
    "tensor_model_parallel_all_gather": "communication_op",
    "verify_tensor_parallel": "utils",
    "divide": "utils",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagoda.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pagoda.distributed.{_EXPORTS[name]}"), name)
