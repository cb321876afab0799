"""Batched sampling: logits [N, V] for N rows (one per request that samples a
token this step) -> one token id per row, plus logprobs where asked for.

Order of processing (vLLM v1's):
  raw logprobs (log_softmax of the logits as the model gave them)
  -> the grammar's bitmask (structured outputs) -> logit_bias, min_tokens
     (EOS/stop ids masked), penalties
  -> greedy rows: argmax here
  -> temperature -> min_p -> top_k -> top_p -> exponential race (in its
     Gumbel-max form over the logits: no softmax).

Logprobs are "raw" (vLLM's default logprobs mode): they describe the model's
distribution, not the one after penalties, temperature or truncation, so they
do not depend on sampling knobs and the chosen token may have any rank.

Randomness: the race's noise for token i of a row is Philox keyed by (seed,
offset, i) (ops.sample_gumbel): the seed is the request's (its generator's
initial_seed()) or, for unseeded rows, a fresh one drawn each step from
`SamplingMetadata.generator` (else torch's global CPU RNG); the offset is the
number of tokens the row has generated. So a seeded request's tokens do not
depend on which other requests share the batch or on the row's position, and
the CPU (ops.gumbel_argmax) and the GPU draw the same stream for one seed. The
engine must only pass rows that really sample this step (not partial prefill
chunks), and num_output_tokens must count every token a row generated.

On CUDA, when the compiled op is loaded, temperature -> min_p -> top_k ->
top_p -> race run in one kernel (ops.sample, cuda/sampling.cu): the same
filters, found without a vocabulary sort. (Where tokens tie with the least
likely one top_p keeps, the GPU keeps them all; the sort keeps an arbitrary
subset.) Elsewhere the filters are torch ops and the race is ops.gumbel_argmax
(the CPU kernel) or, without it, its torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from pagoda import _native, ops
from pagoda.ops import apply_min_p, apply_top_k_top_p
from pagoda.outputs import TokenLogprobs
from pagoda.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own generator, on the logits' device; keep it with the
    request (one per row when n > 1, e.g. seeds seed, seed + 1, ...)."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step, built by the engine (from_requests).
    Optional tensors are None when no row uses the feature, so its work is skipped."""

    temperature: torch.Tensor  # [N] float32; 0 marks a greedy row
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # [N] int64, 0 = off
    top_p: torch.Tensor | None = None  # [N] float32, 1 = off
    min_p: torch.Tensor | None = None  # [N] float32, 0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> its request's generator
    generator: torch.Generator | None = None  # for unseeded rows; None = torch's global RNG
    presence_penalties: torch.Tensor | None = None  # [N]
    frequency_penalties: torch.Tensor | None = None  # [N]
    repetition_penalties: torch.Tensor | None = None  # [N]
    prompt_token_ids: Sequence[Sequence[int]] | None = None  # per row; needed for repetition_penalty
    output_token_ids: Sequence[Sequence[int]] = ()  # per row: tokens generated so far
    num_output_tokens: Sequence[int] = ()  # per row: how many (ids still on the device included)
    min_tokens: dict[int, list[int]] = field(default_factory=dict)  # row -> token ids to mask (still below min_tokens)
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)  # row -> {token id: bias}
    num_logprobs: list[int | None] | None = None  # per row; None when no row asks
    # Structured outputs: [N, ceil(V / 32)] int32 on the logits' device, bit j
    # of row i set where row i may pick token j (xgrammar's packing), for the
    # rows in grammar_rows (the others are not read).
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] = field(default_factory=list)

    @property
    def uses_penalties(self) -> bool:
        """A row's sampling depends on the ids generated so far (not just their count)."""
        return self.presence_penalties is not None or self.repetition_penalties is not None

    @property
    def edits_logits(self) -> bool:
        """Some row's logits change before sampling (grammar, bias, min_tokens, penalties)."""
        return (self.grammar_bitmask is not None or bool(self.logit_bias) or any(self.min_tokens.values())
                or self.uses_penalties)

    @property
    def max_num_logprobs(self) -> int | None:
        if self.num_logprobs is None:
            return None
        return max((k for k in self.num_logprobs if k is not None), default=None)

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        eos_token_ids: Sequence[int] = (),
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
        num_output_tokens: Sequence[int] | None = None,
    ) -> SamplingMetadata:
        """One row per (request, sample): `generators[i]` is row i's own
        generator (None when unseeded); `eos_token_ids` are masked with the
        stop ids while a row has fewer than min_tokens outputs.
        `num_output_tokens[i]`: tokens row i generated before this one
        (default: len(output_token_ids[i]); more when some ids are still on
        the device -- penalties need them all on the host)."""
        if len(output_token_ids) != len(params):
            raise ValueError(f"{len(params)} rows of params but {len(output_token_ids)} of output_token_ids")
        if num_output_tokens is None:
            num_output_tokens = [len(t) for t in output_token_ids]

        def floats(name):
            return to_device([getattr(p, name) for p in params], torch.float32, device)

        temperature = floats("temperature")
        greedy = [p.temperature == 0.0 for p in params]
        md = cls(temperature=temperature, all_greedy=all(greedy), all_random=not any(greedy),
                 output_token_ids=output_token_ids, num_output_tokens=num_output_tokens, generator=generator)
        if any(p.top_k > 0 for p in params):
            md.top_k = to_device([p.top_k for p in params], torch.int64, device)
        if any(p.top_p < 1.0 for p in params):
            md.top_p = floats("top_p")
        if any(p.min_p > 0.0 for p in params):
            md.min_p = floats("min_p")
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            md.presence_penalties = floats("presence_penalty")
            md.frequency_penalties = floats("frequency_penalty")
        if any(p.repetition_penalty != 1.0 for p in params):
            if prompt_token_ids is None:
                raise ValueError("repetition_penalty needs prompt_token_ids")
            md.repetition_penalties = floats("repetition_penalty")
            md.prompt_token_ids = prompt_token_ids
        if generators is not None:
            md.generators = {i: g for i, g in enumerate(generators) if g is not None and not greedy[i]}
        for i, p in enumerate(params):
            if num_output_tokens[i] < p.min_tokens:
                md.min_tokens[i] = sorted(set(p.stop_token_ids) | set(eos_token_ids))
            if p.logit_bias:
                md.logit_bias[i] = p.logit_bias
        if any(p.logprobs is not None for p in params):
            md.num_logprobs = [p.logprobs for p in params]
        return md


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None] | None = None  # per row, trimmed to that row's k; None if no row asked


@dataclass
class DeviceSamplerOutput:
    """A step's samples still on the logits' device: nothing has waited for
    the GPU. start_copy_to_host() queues their copy into pinned memory;
    to_host() waits for it and returns the plain SamplerOutput."""

    sampled: torch.Tensor  # [N] int64: the next step's input ids for these rows
    logprob_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # see _logprob_tensors
    num_logprobs: Sequence[int | None] | None = None
    _host: list[torch.Tensor] | None = None  # pinned copies of sampled and logprob_tensors
    _copied: torch.cuda.Event | None = None

    def _tensors(self) -> list[torch.Tensor]:
        return [self.sampled, *(self.logprob_tensors or ())]

    def start_copy_to_host(self) -> None:
        if self.sampled.is_cuda:
            self._host = [_to_pinned(t) for t in self._tensors()]
            self._copied = torch.cuda.Event()
            self._copied.record()

    def to_host(self) -> SamplerOutput:
        if self._copied is not None:
            self._copied.synchronize()
        sampled, *logprob_tensors = self._host or self._tensors()
        out = SamplerOutput(sampled_token_ids=sampled.tolist())
        if logprob_tensors:
            out.logprobs = _logprob_lists(*logprob_tensors, self.num_logprobs)
        return out


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        return self.sample(logits, md).to_host()

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> DeviceSamplerOutput:
        """Like forward, without waiting for the device."""
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        if not md.edits_logits and (md.all_greedy or _samples_on_gpu(logits)):
            # Nothing edits the logits and the choice only reads them: no
            # private copy (at 256 rows of a 128k vocabulary, a 131 MB pass).
            out = DeviceSamplerOutput(self._sample(logits, md))
        else:
            # A private float32 copy: the steps below work in place.
            logits = logits.to(torch.float32, copy=True)
            apply_grammar_bitmask(logits, md)
            apply_logit_bias(logits, md.logit_bias)
            apply_min_tokens(logits, md.min_tokens)
            apply_penalties(logits, md)
            out = DeviceSamplerOutput(self._sample(logits, md))
        if raw_logprobs is not None:
            out.logprob_tensors = _logprob_tensors(raw_logprobs, out.sampled, md.max_num_logprobs)
            out.num_logprobs = md.num_logprobs
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_greedy:
            return _argmax(logits)
        if _samples_on_gpu(logits):
            return _sample_on_gpu(logits, md)
        greedy = None if md.all_random else _argmax(logits)
        is_greedy = md.temperature == 0.0
        # Greedy rows divide by 1 (their random draw is discarded below).
        logits.div_(torch.where(is_greedy, 1.0, md.temperature).unsqueeze(1))
        if md.min_p is not None:
            apply_min_p(logits, md.min_p)
        if md.top_k is not None or md.top_p is not None:
            apply_top_k_top_p(logits, md.top_k, md.top_p)
        seeds, offsets = race_keys(md, logits.shape[0])
        if logits.device.type == "cpu" and seeds.device.type == "cpu" and _native.has_kernel("gumbel_argmax", "cpu"):
            sampled = ops.gumbel_argmax(logits, seeds, offsets)
        else:
            sampled = ops.gumbel_argmax_reference(logits, seeds.to(logits.device), offsets.to(logits.device))
        return sampled if greedy is None else torch.where(is_greedy, greedy, sampled)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: on the CPU the native kernel on the logits
    widened to float32 (ops.greedy_argmax: a third of torch's time there),
    else torch's (widening changes no value, so neither the argmax)."""
    if logits.device.type == "cpu" and _native.has_kernel("greedy_argmax", "cpu"):
        return ops.greedy_argmax(logits.float())
    return logits.argmax(dim=-1)


def race_keys(md: SamplingMetadata, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the race noise's seed and offset (int64; the seeds on the
    generator's device), as the module docstring says."""
    gen = md.generator
    if len(md.generators) < n:  # one draw per step serves every unseeded row
        seeds = torch.randint(0, 2**63 - 1, (n,), dtype=torch.int64, generator=gen,
                              device=gen.device if gen is not None else "cpu")
    else:
        seeds = torch.zeros(n, dtype=torch.int64)
    if md.generators:
        # initial_seed() is a uint64; the kernels take its bits as an int64.
        own = [g.initial_seed() for g in md.generators.values()]
        seeds[list(md.generators)] = torch.tensor([s - 2**64 if s >= 2**63 else s for s in own],
                                                  dtype=torch.int64, device=seeds.device)
    offsets = torch.tensor(list(md.num_output_tokens) if md.num_output_tokens else [0] * n, dtype=torch.int64)
    return seeds, offsets


_GPU_SAMPLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _samples_on_gpu(logits: torch.Tensor) -> bool:
    """Whether _sample takes ops.sample, which reads the logits without
    changing them (on CUDA, in float32, bf16 or fp16: it widens each value to
    float32 as it reads it)."""
    return logits.is_cuda and logits.dtype in _GPU_SAMPLE_DTYPES and _native.has_kernel("sample")


def _sample_on_gpu(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """ops.sample over all rows; seeds and offsets as the module docstring says."""
    seeds, offsets = race_keys(md, logits.shape[0])

    def on_device(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else to_device(t, t.dtype, logits.device)

    return ops.sample(logits, on_device(md.temperature), on_device(seeds), on_device(offsets),
                      top_k=on_device(md.top_k), top_p=on_device(md.top_p), min_p=on_device(md.min_p))


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list or tensor on `device` without waiting for the GPU: a copy
    from pageable memory would first wait for all queued work (CUDA's rule),
    one from pinned memory is queued behind it."""
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return values.to(device=device, dtype=dtype)
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A non-blocking device-to-host copy into pinned memory (valid once
    an event recorded after it has completed)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def apply_grammar_bitmask(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Tokens a row's grammar forbids get -inf (xgrammar's kernel: C++ on
    the CPU, Triton on CUDA; in place)."""
    if md.grammar_bitmask is None:
        return
    import xgrammar

    rows = md.grammar_rows
    if logits.is_cuda:  # xgrammar would copy a list from pageable memory: a wait for the queued work
        rows = to_device(rows, torch.int32, logits.device)
    xgrammar.apply_token_bitmask_inplace(logits, md.grammar_bitmask, indices=rows)


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> None:
    if not logit_bias:
        return
    rows = [r for r, b in logit_bias.items() for _ in b]
    cols = [t for b in logit_bias.values() for t in b]
    vals = [v for b in logit_bias.values() for v in b.values()]
    idx = (to_device(rows, torch.int64, logits.device), to_device(cols, torch.int64, logits.device))
    logits.index_put_(idx, to_device(vals, logits.dtype, logits.device), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, list[int]]) -> None:
    """Rows still below min_tokens cannot pick EOS or a stop token id."""
    rows = [r for r, ids in min_tokens.items() for _ in ids]
    if rows:
        cols = [t for ids in min_tokens.values() for t in ids]
        idx = (to_device(rows, torch.int64, logits.device), to_device(cols, torch.int64, logits.device))
        # A tensor made on the device: a Python scalar would be copied there, and wait.
        logits.index_put_(idx, torch.full((len(rows),), float("-inf"), device=logits.device))


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """[N, V] int counts of each token per row, from ragged lists (padded with V,
    a spare column that is dropped)."""
    n = len(token_ids)
    width = max((len(t) for t in token_ids), default=0)
    padded = torch.full((n, width), vocab_size, dtype=torch.int64)
    for i, t in enumerate(token_ids):
        if len(t):
            padded[i, : len(t)] = torch.as_tensor(t, dtype=torch.int64)
    counts = torch.zeros((n, vocab_size + 1), dtype=torch.int32, device=device)
    index = to_device(padded, torch.int64, device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """repetition_penalty (HF/CTRL: over prompt and output tokens, positive
    logits divided, negative multiplied); frequency and presence penalties
    (OpenAI: over output tokens, subtract count * f and [count > 0] * p)."""
    if not md.uses_penalties:
        return
    n, vocab = logits.shape
    out_counts = _token_counts(md.output_token_ids, vocab, logits.device)
    if md.repetition_penalties is not None:
        seen = (_token_counts(md.prompt_token_ids, vocab, logits.device) > 0) | (out_counts > 0)
        rep = md.repetition_penalties.unsqueeze(1).expand(n, vocab)
        rep = torch.where(seen, rep, 1.0)
        logits.copy_(torch.where(logits > 0, logits / rep, logits * rep))
    if md.presence_penalties is not None:
        logits.sub_(md.frequency_penalties.unsqueeze(1) * out_counts)
        logits.sub_(md.presence_penalties.unsqueeze(1) * (out_counts > 0))


def _logprob_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: ids [N, 1 + k] and logprobs [N, 1 + k] of the given token then
    the top-k, and the given token's rank [N] (1 + the number of strictly
    more likely tokens)."""
    k = min(k, logprobs.shape[1])
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_vals, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([token_ids.unsqueeze(1), top_ids], dim=1), torch.cat([chosen, top_vals], dim=1), ranks


def _logprob_lists(ids: torch.Tensor, vals: torch.Tensor, ranks: torch.Tensor,
                   per_row_k: Sequence[int | None] | None = None) -> list[TokenLogprobs | None]:
    """_logprob_tensors' rows as plain lists, each trimmed to its row's k."""
    ids, vals, ranks = ids.tolist(), vals.tolist(), ranks.tolist()
    out: list[TokenLogprobs | None] = []
    for i in range(len(ids)):
        row_k = len(ids[i]) - 1 if per_row_k is None else per_row_k[i]
        out.append(None if row_k is None else TokenLogprobs(ids[i][: row_k + 1], vals[i][: row_k + 1], ranks[i]))
    return out


def compute_token_logprobs(logits: torch.Tensor, target_token_ids: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Row i of logits scored against target_token_ids[i] (raw logprobs)."""
    targets = torch.as_tensor(list(target_token_ids), dtype=torch.int64, device=logits.device)
    return _logprob_lists(*_logprob_tensors(torch.log_softmax(logits.float(), dim=-1), targets, k))


def compute_prompt_logprobs(logits: torch.Tensor, prompt_token_ids: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Prompt logprobs from the logits at prompt positions [P, V]: position i
    predicts token i + 1, so this returns P - 1 entries for prompt tokens
    1..P-1 (vLLM's list starts with None for token 0; the caller adds it).
    With chunked prefill, score each chunk with compute_token_logprobs
    against the next P tokens instead."""
    if logits.shape[0] != len(prompt_token_ids):
        raise ValueError(f"logits has {logits.shape[0]} rows but the prompt has {len(prompt_token_ids)} tokens")
    return compute_token_logprobs(logits[:-1], list(prompt_token_ids)[1:], k)
