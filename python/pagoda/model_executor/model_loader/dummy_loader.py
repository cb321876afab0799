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
    between runs). Reads no file."""
    generators: dict[torch.device, torch.Generator] = {}
    norm_params = {
        id(p) for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm)) for p in m.parameters(recurse=False)
    }
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            param.data.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            # Generate in fp32, row block by row block: the same values for
            # every dtype, and no full-size fp32 copy.
            device = param.device
            if device not in generators:
                generators[device] = torch.Generator(device=device).manual_seed(seed)
            flat = param.data.view(-1, param.shape[-1]) if param.dim() > 1 else param.data.view(1, -1)
            for start in range(0, flat.shape[0], 4096):
                block = flat[start : start + 4096]
                block.copy_(torch.randn(block.shape, generator=generators[device], device=device) * std)
