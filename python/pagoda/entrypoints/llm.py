"""The offline API, with vLLM's names: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from tqdm import tqdm

from pagoda.config import probable_device_type
from pagoda.engine.arg_utils import EngineArgs
from pagoda.outputs import RequestOutput, RequestOutputKind
from pagoda.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """An LLM with a paged KV cache and continuous batching, for offline batches.

    model: a Hugging Face folder (config.json + safetensors), a .gguf file, or a
    folder holding one .gguf file. kv_cache_space: the CPU KV cache size, in GiB
    (or bytes when >= 4096), like vLLM's VLLM_CPU_KVCACHE_SPACE. On a GPU
    (device="auto" finds one) the KV cache takes what gpu_memory_utilization
    of the device's memory leaves after the weights and a profiling forward
    pass; enforce_eager=True turns CUDA graphs off. The arguments
    are EngineArgs' (shared with AsyncLLM); disable_log_stats=False logs a
    throughput/KV-usage line every 10 s while generating.

    multiprocess: the engine core (scheduler, model, sampler) in a process
    of its own, as `pagoda serve` runs it (vLLM v1's design): it steps while
    this process detokenizes, so on a GPU the host's per-step work is
    split over two interpreters. None (the default): on where the model
    runs on a GPU. False keeps the core here, reachable for inspection
    (llm.llm_engine.scheduler, .runner); on the CPU the model's threads
    take every core, so a second process would only compete with them.
    shutdown() stops the core's process (so does dropping the LLM).
    """

    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        seed: int = 0,
        device: str = "auto",
        load_format: str = "auto",
        kv_cache_space: float = 4,
        enforce_eager: bool = False,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        disable_log_stats: bool = True,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        multiprocess: bool | None = None,
        **kwargs: Any,  # any other EngineArgs field, as vLLM's LLM takes them
    ):
        args = EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, seed=seed, device=device,
            load_format=load_format, kv_cache_space=kv_cache_space, enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, num_gpu_blocks_override=num_gpu_blocks_override,
            disable_log_stats=disable_log_stats,
            enable_prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy, **kwargs,
        )
        if multiprocess is None:
            # Without importing torch: the core's process then starts before
            # this one imports it, and the two imports overlap.
            multiprocess = probable_device_type(args.device) == "cuda"
        if not isinstance(multiprocess, bool):
            raise ValueError(f"multiprocess must be a bool or None, got {multiprocess!r}")
        self.llm_engine = args.create_engine(multiprocess)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stops the engine (its core's process, its workers' processes)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix, so prompts run again are computed
        again (a benchmark's repeated runs); False while requests hold KV
        blocks (none do between generate() calls)."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Completes every prompt; returns one RequestOutput per prompt, in order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids" (vLLM's TextPrompt / TokensPrompt). `priority`, one
        per prompt, matters under scheduling_policy="priority" (lower first)."""
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts: pass one or one per prompt"
                )
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompt_list)} prompts: pass one per prompt")
        request_ids = []
        try:
            for prompt, params, prio in zip(prompt_list, params_list, priorities):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params, priority=prio,
                                            output_kind=RequestOutputKind.FINAL_ONLY)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            # Leave no half-finished batch holding KV blocks behind.
            self.llm_engine.abort_request(request_ids)
            raise

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template (or `chat_template`) to one
        conversation or a list of them, then generates."""
        prompts = self.chat_prompts(messages, chat_template, add_generation_prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompts(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[dict[str, Any]]:
        """The {"prompt_token_ids": ...} prompts chat() generates from: one per
        conversation, the chat template applied."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (its chat template), but the engine has skip_tokenizer_init=True")
        prompts = []
        for conversation in conversations:
            if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
                raise ValueError("messages must be a list of {'role', 'content'} dicts, or a list of such lists")
            token_ids = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=True
            )
            if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):
                token_ids = token_ids["input_ids"]
            prompts.append({"prompt_token_ids": list(token_ids)})
        return prompts

    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        started, generated = time.perf_counter(), 0
        with bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        generated += sum(len(o.token_ids) for o in output.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {generated / (time.perf_counter() - started):.1f} tok/s")
        return [finished[request_id] for request_id in request_ids]
