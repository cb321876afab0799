"""Benchmark workloads (vLLM's benchmarks/datasets.py): requests of random
token ids whose input and output lengths are drawn uniformly from a range,
reproducible from a seed, plus named presets of published workloads.

Prompts are token ids, never text: a decode/re-encode round trip would change
their lengths, and a model shape has no tokenizer anyway."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace

from pagoda.entrypoints.cli_args import non_negative_int, positive_int

DEFAULT_NUM_PROMPTS, DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 32, 128, 64


@dataclass
class SampleRequest:
    """One benchmark request (vLLM's name): its prompt and how many tokens
    it should generate; prompt: its text, for clients that send text."""

    prompt_token_ids: list[int]
    expected_output_len: int
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class DatasetSpec:
    """What to sample: the number of requests and inclusive [low, high] ranges
    of prompt and output lengths. prefix_len tokens, the same for every
    request, go in front of each prompt (vLLM's --random-prefix-len)."""

    num_prompts: int
    input_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    prefix_len: int = 0
    ignore_eos: bool = False  # part of the workload's definition (presets)

    def describe(self) -> str:
        def span(r):
            return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"

        prefix = f"{self.prefix_len} shared + " if self.prefix_len else ""
        return (f"{self.num_prompts} prompts, input {prefix}{span(self.input_len_range)} tokens, "
                f"output {span(self.output_len_range)} tokens")


# nano-vllm's bench.py: 256 requests, prompt and output lengths uniform in
# [100, 1024], EOS ignored.
PRESETS = {"nano-vllm": DatasetSpec(256, (100, 1024), (100, 1024), ignore_eos=True)}


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random dataset: lengths uniform in [len * (1 - r), len * (1 + r)]
    (at least 1)."""
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio!r}")
    return max(1, int(length * (1 - range_ratio))), int(length * (1 + range_ratio))


def special_token_ids(hf_config) -> set[int]:
    """BOS/EOS/pad ids from a model config: left out of random prompts so an
    EOS inside a prompt cannot confuse a reader of the outputs."""
    ids: set[int] = set()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(hf_config, name, None)
        ids.update([value] if isinstance(value, int) else [v for v in value or () if isinstance(v, int)])
    return ids


class RandomDataset:
    """Random token ids from [0, vocab_size) minus exclude_token_ids; the same
    seed gives the same requests."""

    def __init__(self, vocab_size: int, seed: int = 0, exclude_token_ids=()):
        self.allowed = sorted(set(range(vocab_size)) - set(exclude_token_ids))
        if not self.allowed:
            raise ValueError(f"no token ids left to sample from a vocabulary of {vocab_size}")
        self.seed = seed

    def sample(self, spec: DatasetSpec) -> list[SampleRequest]:
        rng = random.Random(self.seed)
        prefix = rng.choices(self.allowed, k=spec.prefix_len)
        requests = []
        for _ in range(spec.num_prompts):
            input_len = rng.randint(*spec.input_len_range)
            output_len = rng.randint(*spec.output_len_range)
            requests.append(SampleRequest(prefix + rng.choices(self.allowed, k=input_len), output_len))
        return requests


def verify_fits(requests: list[SampleRequest], max_model_len: int) -> None:
    """Every request's prompt plus output must fit in the model's context."""
    longest = max(requests, key=lambda r: r.prompt_len + r.expected_output_len)
    if longest.prompt_len + longest.expected_output_len > max_model_len:
        raise ValueError(
            f"a request needs {longest.prompt_len} prompt + {longest.expected_output_len} output tokens, over "
            f"max_model_len={max_model_len}: raise --max-model-len or shorten the workload")


def as_text(requests: list[SampleRequest], tokenizer_path: str) -> list[SampleRequest]:
    """The requests with text prompts, as vLLM's random dataset gives them:
    the ids decoded, so the engine tokenizes (the text may encode to a few
    more or fewer tokens; what the engine counted is reported)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    texts = tokenizer.batch_decode([r.prompt_token_ids for r in requests])
    return [SampleRequest(r.prompt_token_ids, r.expected_output_len, text) for r, text in zip(requests, texts)]


def sample_requests(args: argparse.Namespace, spec: DatasetSpec, vocab_size: int,
                    exclude_token_ids=()) -> list[SampleRequest]:
    """The workload of add_dataset_args' flags: random ids of the vocabulary
    (--seed), as text where --prompt-tokenizer says so."""
    requests = RandomDataset(vocab_size, args.seed, exclude_token_ids).sample(spec)
    return as_text(requests, args.prompt_tokenizer) if args.prompt_tokenizer else requests


def _range_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return value


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", default="random", choices=["random", *PRESETS],
                       help="random: lengths from the --random-* flags; nano-vllm: 256 requests, input and "
                            "output lengths uniform in [100, 1024], EOS ignored")
    group.add_argument("--num-prompts", type=positive_int, default=None,
                       help=f"default: {DEFAULT_NUM_PROMPTS}, or a preset's own count")
    group.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=positive_int,
                       default=None, help=f"prompt tokens (default {DEFAULT_INPUT_LEN})")
    group.add_argument("--random-output-len", "--output-len", dest="random_output_len", type=positive_int,
                       default=None, help=f"output tokens (default {DEFAULT_OUTPUT_LEN})")
    group.add_argument("--random-range-ratio", type=_range_ratio, default=None,
                       help="lengths uniform in [len * (1 - r), len * (1 + r)] (default 0: fixed lengths)")
    group.add_argument("--random-prefix-len", type=non_negative_int, default=None,
                       help="tokens of one shared prefix in front of every prompt (default 0)")
    group.add_argument("--prompt-tokenizer", default=None, metavar="DIR",
                       help="text prompts (vLLM's random dataset gives them): the random ids decoded with this "
                            "Hugging Face tokenizer folder, tokenized again by the engine (default: token-id prompts)")


def get_dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    """The DatasetSpec add_dataset_args' flags describe (checked before any
    model loads)."""
    random_flags = {"--random-input-len": args.random_input_len, "--random-output-len": args.random_output_len,
                    "--random-range-ratio": args.random_range_ratio, "--random-prefix-len": args.random_prefix_len}
    if args.dataset_name != "random":
        given = [flag for flag, value in random_flags.items() if value is not None]
        preset = PRESETS[args.dataset_name]
        if given:
            raise ValueError(f"{', '.join(given)} do not apply to --dataset-name {args.dataset_name} "
                             f"({preset.describe()})")
        return replace(preset, num_prompts=args.num_prompts or preset.num_prompts)
    ratio = args.random_range_ratio or 0.0
    return DatasetSpec(
        num_prompts=args.num_prompts or DEFAULT_NUM_PROMPTS,
        input_len_range=length_range(args.random_input_len or DEFAULT_INPUT_LEN, ratio),
        output_len_range=length_range(args.random_output_len or DEFAULT_OUTPUT_LEN, ratio),
        prefix_len=args.random_prefix_len or 0,
    )
