"""Public models' config.json values (no weights, no tokenizer), one folder
per model, for benchmarks with dummy weights: `--model-shape Qwen3-0.6B`.
With EOS ignored, throughput depends on the shapes, not on weight values."""

from __future__ import annotations

from pathlib import Path

MODEL_SHAPES_DIR = Path(__file__).parent


def available_model_shapes() -> list[str]:
    return sorted(p.name for p in MODEL_SHAPES_DIR.iterdir() if (p / "config.json").is_file())


def model_shape_path(name: str) -> str:
    """The folder of the shape `name` (a model path for LLM / ModelConfig)."""
    if name not in available_model_shapes():
        raise ValueError(f"model shape {name!r} is unknown; the repo has {available_model_shapes()}")
    return str(MODEL_SHAPES_DIR / name)
