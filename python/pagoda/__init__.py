"""Pagoda: a high-throughput LLM inference and serving engine.

`from pagoda import LLM, SamplingParams` as with vLLM. The engine classes load
lazily, so importing the package (e.g. for SamplingParams) needs no compiled
kernels.
"""

from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.version import __version__

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagoda.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
