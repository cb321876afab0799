"""The random workloads: lengths inside their ranges, the same requests for
the same seed, excluded ids never drawn, presets and flag checks."""

import argparse

import pytest

from pagoda.benchmarks.datasets import (PRESETS, DatasetSpec, RandomDataset, add_dataset_args, get_dataset_spec,
                                        length_range, special_token_ids, verify_fits)


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    return parser.parse_args(list(argv))


def test_lengths_in_range_and_ids_in_vocabulary():
    spec = DatasetSpec(200, (5, 40), (1, 9), prefix_len=3)
    requests = RandomDataset(100, seed=1, exclude_token_ids={0, 1, 2}).sample(spec)
    assert len(requests) == 200
    assert all(3 + 5 <= r.prompt_len <= 3 + 40 and 1 <= r.expected_output_len <= 9 for r in requests)
    assert all(3 <= t < 100 for r in requests for t in r.prompt_token_ids)
    assert len({tuple(r.prompt_token_ids[:3]) for r in requests}) == 1  # the shared prefix
    # Uniform draws over a wide range: both ends are reached, lengths vary.
    lens = [r.prompt_len - 3 for r in requests]
    assert min(lens) <= 8 and max(lens) >= 37
    assert len({r.expected_output_len for r in requests}) == 9


def test_seed_reproducible():
    spec = DatasetSpec(20, (10, 30), (5, 15))
    first = RandomDataset(1000, seed=7).sample(spec)
    again = RandomDataset(1000, seed=7).sample(spec)
    other = RandomDataset(1000, seed=8).sample(spec)
    assert first == again
    assert first != other


def test_length_range_is_vllms():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.5) == (50, 150)
    assert length_range(1, 0.9) == (1, 1)  # never below one token
    with pytest.raises(ValueError, match="random_range_ratio"):
        length_range(100, 1.0)
    with pytest.raises(ValueError, match="length"):
        length_range(0, 0.1)


def test_flags_make_the_spec():
    spec = get_dataset_spec(parse("--num-prompts", "5", "--input-len", "100", "--random-output-len", "20",
                                  "--random-range-ratio", "0.25", "--random-prefix-len", "4"))
    assert spec == DatasetSpec(5, (75, 125), (15, 25), prefix_len=4)
    assert get_dataset_spec(parse()) == DatasetSpec(32, (128, 128), (64, 64))


def test_nano_vllm_preset():
    spec = get_dataset_spec(parse("--dataset-name", "nano-vllm"))
    assert spec == PRESETS["nano-vllm"]
    assert (spec.num_prompts, spec.input_len_range, spec.output_len_range, spec.ignore_eos) == (
        256, (100, 1024), (100, 1024), True)
    assert get_dataset_spec(parse("--dataset-name", "nano-vllm", "--num-prompts", "8")).num_prompts == 8
    with pytest.raises(ValueError, match="--random-input-len do not apply to --dataset-name nano-vllm"):
        get_dataset_spec(parse("--dataset-name", "nano-vllm", "--input-len", "10"))


@pytest.mark.parametrize("argv", [["--random-range-ratio", "1"], ["--random-range-ratio", "x"],
                                  ["--num-prompts", "0"], ["--input-len", "-3"], ["--random-prefix-len", "-1"],
                                  ["--dataset-name", "sharegpt"]])
def test_bad_flags_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_special_ids_and_fit_check():
    class Config:
        bos_token_id, eos_token_id, pad_token_id = 1, [2, 3], None

    assert special_token_ids(Config()) == {1, 2, 3}
    requests = RandomDataset(50).sample(DatasetSpec(3, (10, 10), (6, 6)))
    verify_fits(requests, 16)
    with pytest.raises(ValueError, match="10 prompt \\+ 6 output tokens, over max_model_len=15"):
        verify_fits(requests, 15)
