"""Hugging Face folders of safetensors: one file or shards listed by
model.safetensors.index.json; tensors stream out one at a time."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"


def safetensors_files(folder: str) -> list[str]:
    """The index's shards, else model.safetensors, else every *.safetensors.
    The index wins because some repositories also hold a second copy of the
    weights in another layout (Mistral's consolidated.safetensors)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"model folder {folder!r} does not exist")
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(folder, "model.safetensors")):
        names = ["model.safetensors"]
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(
            f"no *.safetensors weights in {folder!r} (it holds: {', '.join(sorted(os.listdir(folder))) or 'nothing'})"
        )
    files = [os.path.join(folder, n) for n in names]
    for path in files:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{INDEX} lists {os.path.basename(path)!r}, which is not in {folder!r}")
    return files


def safetensors_weights_iterator(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) with floating tensors cast to dtype, one at a time."""
    for path in files:
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
        for name in names:
            # A fresh handle per tensor: safe_open maps the whole file, and
            # every page read through a handle stays resident until it closes,
            # so reading a whole shard through one handle would hold a second
            # copy of the weights at the end (peak RSS ~2x instead of ~1x).
            with safe_open(path, framework="pt") as f:
                tensor = f.get_tensor(name)
            yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
