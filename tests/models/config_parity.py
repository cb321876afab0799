"""Pagoda's own model config (transformers_utils.hf_config.HFConfig, from a
config.json or a GGUF file) against the transformers config of the same
model, for every attribute the engine reads, and a fresh process's check that
a code path imports none of transformers' config classes."""

import os
import subprocess
import sys

import torch

from pagoda.benchmarks.datasets import special_token_ids
from pagoda.distributed.utils import verify_tensor_parallel
from pagoda.model_executor.layers.rotary_embedding import rope_parameters_from_config
from pagoda.model_executor.models.registry import get_model_class

MISSING = object()
# What ModelConfig, the processor and the benchmarks read from a config
# (the model's reads are recorded).
ENGINE_FIELDS = ("model_type", "architectures", "vocab_size", "max_position_embeddings", "dtype",
                 "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "use_sliding_window", "sliding_window")


class Recorder:
    """A config whose attribute reads are written down (the attributes the
    engine reads, whatever code reads them)."""

    def __init__(self, config):
        self._config, self.names = config, set()

    def __getattr__(self, name):
        self.names.add(name)
        return getattr(self._config, name)


def plain(value):
    """transformers holds the dtype as a torch.dtype, config.json (and
    Pagoda's config) as its name."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def assert_same_config(ours, theirs):
    """Every attribute Pagoda reads building the engine and the model (set or
    not, by any code; the model is built on the meta device) is equal in
    `ours` and `theirs`, every attribute ours holds equals transformers', and
    to_transformers() is transformers' config itself."""
    recorder = Recorder(ours)
    with torch.device("meta"):  # the model's modules without their memory
        get_model_class(recorder)(recorder, torch.float32)
    verify_tensor_parallel(recorder, 1)
    special_token_ids(recorder)
    read = recorder.names | set(ENGINE_FIELDS)
    assert ({name: plain(getattr(ours, name, MISSING)) for name in read}
            == {name: plain(getattr(theirs, name, MISSING)) for name in read})
    assert rope_parameters_from_config(ours) == rope_parameters_from_config(theirs)
    assert ours.to_dict() == {name: plain(getattr(theirs, name)) for name in ours.to_dict()}
    converted = ours.to_transformers()
    assert type(converted) is type(theirs)
    # The one difference: transformers notes that it moved a top-level
    # partial_rotary_factor into rope_parameters, where ours already holds it.
    internal = {"ignore_keys_at_rope_validation"}
    assert ({k: v for k, v in vars(converted).items() if k not in internal}
            == {k: v for k, v in vars(theirs).items() if k not in internal})


# Modules a serving path must not import: any transformers config class
# imports the others on the way (about 52 MB of the process; docs/BENCHMARKS.md).
HEAVY_MODULES = ("transformers.models.llama.configuration_llama", "transformers.models.mistral.configuration_mistral",
                 "transformers.models.qwen2.configuration_qwen2", "transformers.models.qwen3.configuration_qwen3",
                 "transformers.models.opt.configuration_opt", "transformers.activations", "torch.distributed.tensor",
                 "sympy", "accelerate")


def imported_modules(script: str, path: str, modules=HEAVY_MODULES) -> list[str]:
    """Runs `script` (which has `path` as PATH) in a fresh interpreter; those
    of `modules` it left in sys.modules."""
    check = f"import sys\nPATH = {path!r}\n{script}\nprint([m for m in {tuple(modules)!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return eval(done.stdout.strip().splitlines()[-1])
