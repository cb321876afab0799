"""Hugging Face's model of a checkpoint on the GPU as the reference for the
engine's outputs.

How outputs are compared (check_greedy):
- float32: tokens equal Hugging Face's greedy continuation exactly.
- bfloat16: a bf16 model's greedy path may leave fp32's at a near-tie, so each
  token is checked against Hugging Face's fp32 log-probabilities given the
  tokens before it (teacher forcing): our log-probability of the token is
  within `tol` of the reference's, and the token is the reference's argmax up
  to 2 x tol. tol = 2 x Hugging Face's own bf16 error on that sequence + 0.02
  (the bound tests/models/test_hf_parity.py uses for logits).
"""

import copy

import torch
from checkpoints import hf_greedy


class Reference:
    """A family's Hugging Face model in fp32 and bf16 on the GPU."""

    def __init__(self, name: str, folder: str, hf):
        self.name, self.folder = name, folder
        self.fp32 = hf.to("cuda")
        self.bf16 = copy.deepcopy(hf).to(torch.bfloat16)

    def logprobs(self, model, tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([tokens], device="cuda")).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    def check_greedy(self, prompt: list[int], output, dtype: str) -> None:
        """output: a RequestOutput of greedy sampling with logprobs >= 0."""
        tokens = output.outputs[0].token_ids
        if dtype == "float32":
            assert tokens == hf_greedy(self.fp32, prompt, len(tokens)), f"{self.name}: prompt {prompt}"
            return
        sequence = prompt + tokens
        rows = slice(len(prompt) - 1, len(sequence) - 1)  # the positions that predict each generated token
        want = self.logprobs(self.fp32, sequence)
        tol = 2 * (self.logprobs(self.bf16, sequence) - want).abs().max().item() + 0.02
        want = want[rows]
        for i, token in enumerate(tokens):
            ours = output.outputs[0].logprobs[i][token].logprob
            assert abs(ours - want[i, token].item()) <= tol, f"{self.name}: token {i} of prompt {prompt}"
            assert want[i, token] >= want[i].max() - 2 * tol, f"{self.name}: token {i} is not greedy, prompt {prompt}"

    def check_prompt_logprobs(self, prompt: list[int], output, dtype: str) -> None:
        """output.prompt_logprobs (k >= 0) against Hugging Face's fp32 ones."""
        want = self.logprobs(self.fp32, prompt)
        tol = 1e-3 if dtype == "float32" else 2 * (self.logprobs(self.bf16, prompt) - want).abs().max().item() + 0.02
        assert output.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            ours = output.prompt_logprobs[position][prompt[position]].logprob
            assert abs(ours - want[position - 1, prompt[position]].item()) <= tol, f"{self.name}: position {position}"
