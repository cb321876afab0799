"""Reasoning split out of generated text (vLLM's --reasoning-parser names):
qwen3 thinks in `<think>...</think>` before its answer. The split is a
function of the text so far, so a stream sends the growth of each part.

Rule (qwen3): an output that begins with `<think>` is reasoning up to
`</think>` (all of it while the tag is not closed) and content after it; any
other output is content (so what a stream has sent stays a prefix of each
part).
"""

from __future__ import annotations

from pagoda.engine.detokenizer import partial_stop_len


class Qwen3ReasoningParser:
    START, END = "<think>", "</think>"

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of the text so far; while not final,
        a tail that may begin the closing tag is held back."""
        body = text.lstrip()
        if not body.startswith(self.START):
            if not final and self.START.startswith(body):
                return None, None  # may still open a <think>
            return None, text or None
        body = body[len(self.START):]
        end = body.find(self.END)
        if end != -1:
            return body[:end].lstrip("\n") or None, body[end + len(self.END):].lstrip("\n") or None
        if not final:
            body = body[: len(body) - partial_stop_len(body, [self.END])]
        return body.lstrip("\n") or None, None


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
