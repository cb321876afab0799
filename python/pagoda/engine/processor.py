"""The front end's input side: a caller's request -> the engine core's
sequences. It tokenizes text, checks every field against the model (ids in
the vocabulary, the prompt against max_model_len), takes the model's
generation_config defaults for fields the caller left unset, and fans a
request with n > 1 out into n sequences (child ids, seeds counted on).
What can be checked here is checked here, so a bad request fails alone, at
once, with a ValueError naming the field."""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

from pagoda.config import ModelConfig
from pagoda.engine.core_messages import EngineCoreRequest
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine import structured_output
from pagoda.engine.output_processor import Completion, RequestState
from pagoda.outputs import RequestMetrics, RequestOutputKind
from pagoda.sampling_params import SamplingParams


def front_end_model_config(args) -> ModelConfig:
    """The front end's view of the model (EngineArgs -> config, vocabulary,
    generation defaults) when the core runs in another process: built for
    the CPU, so this process never touches the GPU, and without the weights'
    quantization, which is the core's (the GPU's dtype and FP8 rules would
    not hold here). What start-up decides (max_model_len, dtype, device)
    comes from the core's ready message."""
    return dataclasses.replace(args, device="cpu", quantization="none").create_model_config()


def load_tokenizer(model_config: ModelConfig):
    from transformers import AutoTokenizer

    if model_config.tokenizer is not None:
        return AutoTokenizer.from_pretrained(model_config.tokenizer)
    if model_config.gguf_file:
        from pagoda.transformers_utils.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(model_config.folder / model_config.gguf_file, model_config.hf_config)
    return AutoTokenizer.from_pretrained(model_config.folder)


def eos_token_ids(model_config: ModelConfig, tokenizer) -> list[int]:
    """Every id that ends a sequence: generation_config's, config.json's and the tokenizer's."""
    ids = set()
    for source in (model_config.generation_config.get("eos_token_id"),
                   getattr(model_config.hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(i for i in source if isinstance(i, int))
    # An id past the model's logits (a tokenizer larger than the model) can
    # never be sampled, and the sampler could not mask it.
    vocab_size = model_config.hf_config.vocab_size
    return sorted(i for i in ids if 0 <= i < vocab_size)


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def ids_outside_vocab(token_ids: list[int], vocab_size: int) -> list[int]:
    """The first few ids not in [0, vocab_size) (empty if none): the common
    all-valid case in two passes in C, as a prompt has thousands of ids."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return []
    return [t for t in token_ids if not 0 <= t < vocab_size][:5]


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer):
        self.model_config = model_config  # max_model_len as the engine core fitted it
        self.tokenizer = tokenizer
        self.vocab_size = model_config.hf_config.vocab_size
        self.generation_defaults = model_config.generation_config

    def process(self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams | None,
                arrival_time: float | None = None, priority: int = 0,
                output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                client_index: int = 0) -> tuple[RequestState, list[EngineCoreRequest]]:
        """Validates a request; ValueError (naming the field) on bad input.
        Returns its front-end state and its core sequences."""
        params = (params or SamplingParams()).clone()
        if self.generation_defaults:
            params.update_from_generation_config(self.generation_defaults)
        params.verify_vocab(self.vocab_size)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer, but the engine has skip_tokenizer_init=True: "
                             "use stop_token_ids")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer, but the engine has skip_tokenizer_init=True")
            structured_output.check(params.structured_outputs)
        text, token_ids = self._tokenize(prompt)
        self._check_length(len(token_ids))
        arrival_time = time.time() if arrival_time is None else arrival_time
        state = RequestState(request_id, text, token_ids, params, [], RequestMetrics(arrival_time=arrival_time),
                             output_kind)
        if params.prompt_logprobs is not None and len(token_ids) == 1:
            state.prompt_logprobs = [None]  # nothing predicts a lone first token
        core_requests = []
        for index in range(params.n):
            sequence_id = child_id(request_id, index, params.n)
            sequence_params = params
            if params.n > 1:
                sequence_params = copy.copy(params)
                sequence_params.n = 1
                if params.seed is not None:
                    # Seeds are 64-bit: the children's count on, wrapping around.
                    sequence_params.seed = (params.seed + index) % 2**64
            detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params)
            state.completions.append(Completion(index, sequence_id, detokenizer))
            core_requests.append(EngineCoreRequest(
                sequence_id, token_ids, sequence_params, arrival_time, priority,
                want_prompt_logprobs=index == 0 and params.prompt_logprobs is not None and len(token_ids) > 1,
                client_index=client_index))
        return state, core_requests

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("the prompt is text, but the engine has skip_tokenizer_init=True (no tokenizer): "
                                 "pass token ids (a list of ints or {'prompt_token_ids': [...]})")
            token_ids = self.tokenizer.encode(prompt)
            bad = ids_outside_vocab(token_ids, self.vocab_size)
            if bad:  # a tokenizer of another model (--tokenizer): its ids would index past the embedding
                raise ValueError(f"prompt: the tokenizer encodes it to ids outside the model's vocabulary "
                                 f"[0, {self.vocab_size}): {bad}; the tokenizer does not match the model")
            return prompt, token_ids
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_ids(self, token_ids) -> list[int]:
        token_ids = list(token_ids)
        # Whole-list passes in C (a prompt has thousands of ids; bool is not an int here).
        if not set(map(type, token_ids)) <= {int}:
            raise ValueError("prompt_token_ids must be a list of ints")
        bad = ids_outside_vocab(token_ids, self.vocab_size)
        if bad:
            raise ValueError(f"prompt_token_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad}")
        return token_ids

    def _check_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens == 0:
            raise ValueError("prompt is empty: it needs at least one token")
        max_len = self.model_config.max_model_len
        if num_prompt_tokens >= max_len:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens but max_model_len is {max_len}: "
                f"a prompt must leave room for at least one generated token"
            )
