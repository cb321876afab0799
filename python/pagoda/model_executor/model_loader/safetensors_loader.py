"""Hugging Face folders of safetensors: one file or shards listed by
model.safetensors.index.json; tensors stream out one at a time."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

from pagoda.model_executor.weight_utils import LazyTensor

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


def safetensors_weights_iterator(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, LazyTensor]]:
    """(name, LazyTensor) one at a time, floating tensors read in dtype. Each
    is read when its weight_loader loads it, and only the slice it narrows
    it to: under tensor parallelism a rank reads its part of the file."""
    for path in files:
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
        for name in names:
            # A fresh handle per tensor: safe_open maps the whole file, and
            # every page read through a handle stays resident until it closes,
            # so reading a whole shard through one handle would hold a second
            # copy of the weights at the end (peak RSS ~2x instead of ~1x).
            # The handle stays open while the consumer loads the tensor.
            with safe_open(path, framework="pt") as f:
                yield name, LazyTensor(f, name, dtype)
