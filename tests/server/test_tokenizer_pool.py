"""TokenizerPool: prompts encode on its threads, so the event loop goes on
while a long prompt tokenizes, and concurrent encodes of one tokenizer give
what encoding them one by one gives."""

import asyncio
import random

import pytest

from conftest import CORPUS, make_tokenizer
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool


def texts(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocabulary = " ".join(CORPUS).split()
    return [" ".join(rng.choices(vocabulary, k=words)) for _ in range(count)]


def test_the_loop_runs_while_a_prompt_tokenizes():
    pool = TokenizerPool(make_tokenizer(), threads=2)
    long_prompt = texts(1, 200_000)[0]

    async def run() -> int:
        encoding = asyncio.ensure_future(pool.encode(long_prompt))
        ticks = 0
        while not encoding.done():
            ticks += 1
            await asyncio.sleep(0)
        assert await encoding == pool.tokenizer.encode(long_prompt)
        return ticks

    try:
        # Inline, the encode would hold the loop until it ended: no ticks.
        assert asyncio.run(run()) > 100
    finally:
        pool.close()


def test_concurrent_encodes_equal_sequential_ones():
    tokenizer = make_tokenizer()
    pool = TokenizerPool(tokenizer, threads=4)
    prompts = texts(64, 300)

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(pool.encode(p, add_special_tokens=i % 2 == 0) for i, p in enumerate(prompts)))

    try:
        assert asyncio.run(run()) == [tokenizer.encode(p, add_special_tokens=i % 2 == 0)
                                      for i, p in enumerate(prompts)]
    finally:
        pool.close()


def test_errors_reach_the_caller_and_threads_are_checked():
    pool = TokenizerPool(make_tokenizer(), threads=1)
    try:
        with pytest.raises(ValueError):  # what the tokenizer raised, on its thread
            asyncio.run(pool.encode(12345))
    finally:
        pool.close()
    with pytest.raises(ValueError, match="at least 1"):
        TokenizerPool(make_tokenizer(), threads=0)
    assert TokenizerPool(make_tokenizer()).threads >= 1
