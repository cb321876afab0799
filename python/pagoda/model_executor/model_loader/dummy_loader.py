"""Random weights with a fixed seed, for benchmarks: throughput does not depend
on the values (with EOS ignored), only on the shapes."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model_executor.layers.layernorm import LayerNorm, RMSNorm


def initialize_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Norm weights 1 and their biases 0 (keeping activations in range), every
    other parameter N(0, std^2), drawn on the parameters' device (a GPU fills
    an 8B model in well under a second; values differ between devices but not
    between runs). Reads no file.

    The values are those of the whole (unsharded) model whatever the tensor
    parallelism: a parameter holding one rank's slice draws its whole tensor
    (full_shape) from the same random stream and takes its slice through its
    weight_loader, so every rank's slices fit together into what one device
    would have drawn."""
    generators: dict[torch.device, torch.Generator] = {}
    norm_params = {
        id(p) for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm)) for p in m.parameters(recurse=False)
    }
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            param.data.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        full_shape = tuple(getattr(param, "full_shape", param.shape))
        if full_shape == tuple(param.shape):
            _fill_normal(param.data, generators[device], std)
        else:
            whole = torch.empty(full_shape, dtype=param.dtype, device=device)
            _fill_normal(whole, generators[device], std)
            param.weight_loader(param, whole)


def _fill_normal(tensor: torch.Tensor, generator: torch.Generator, std: float) -> None:
    # Generate in fp32, row block by row block: the same values for every
    # dtype, and no full-size fp32 copy.
    flat = tensor.view(-1, tensor.shape[-1]) if tensor.dim() > 1 else tensor.view(1, -1)
    for start in range(0, flat.shape[0], 4096):
        block = flat[start : start + 4096]
        block.copy_(torch.randn(block.shape, generator=generator, device=tensor.device) * std)
