"""Building blocks of the models (vLLM's names, no tensor parallelism yet)."""
