"""The tokenizer of a GGUF model built from the file's metadata: byte-level BPE
(tokenizer.ggml.model "gpt2": Llama 3, Qwen, SmolLM, Mistral Nemo) from the
tokens and merges, the split pattern tokenizer.ggml.pre names, control and
user-defined tokens, the special tokens and the chat template. It is the
tokenizer transformers builds for the file (AutoTokenizer.from_pretrained(
folder, gguf_file=name)): the same backend, class and settings, so the same
token ids, without transformers reading the file again for a config.
Other tokenizer models (sentencepiece "llama", "t5", ...) still go through
transformers."""

from __future__ import annotations

from pathlib import Path

from pagoda.heap import return_freed_heap
from pagoda.logger import init_logger
from pagoda.transformers_utils.gguf_reader import GGUFHeader, read_gguf_header

logger = init_logger(__name__)

# llama.cpp's token types (llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# GPT-2's tokenizer class, which transformers builds the BPE through, adds
# this as a special token (at the end of the vocabulary if the file lacks it).
_GPT2_DEFAULT_SPECIAL = "<|endoftext|>"

# Split patterns by tokenizer.ggml.pre: the text is cut into pieces, then each
# piece is byte-level BPE'd. A name not here keeps GPT-2's own pattern.
_CONTRACTIONS = "'s|'t|'re|'ve|'m|'ll|'d"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TAIL = r"|\s*[\r\n]+|\s+(?!\S)|\s+"  # newlines, then spaces not before a word, then other spaces


def _words(digits: str, letters: str = r"\p{L}+", punctuation: str = r"[^\s\p{L}\p{N}]+") -> str:
    return rf"(?i:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?{letters}|\p{{N}}{digits}| ?{punctuation}[\r\n]*" + _TAIL


def _cased(digits: str, contractions: str, punctuation_end: str) -> str:
    word = rf"[^\r\n\p{{L}}\p{{N}}]?"
    return (rf"{word}{_UPPER}*{_LOWER}+{contractions}|{word}{_UPPER}+{_LOWER}*{contractions}"
            rf"|\p{{N}}{digits}| ?[^\s\p{{L}}\p{{N}}]+{punctuation_end}" + _TAIL)


_LLAMA3 = _words("{1,3}")
_QWEN2 = _words("")
_QWEN35 = _words("", letters=r"[\p{L}\p{M}]+", punctuation=r"[^\s\p{L}\p{M}\p{N}]+")
_TEKKEN = _cased("", "", r"[\r\n/]*")
_GPT4O = _cased("{1,3}", f"(?i:{_CONTRACTIONS})?", r"[\r\n/]*")
SPLIT_PATTERNS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def byte_spelling() -> dict[int, str]:
    """Byte-level BPE's byte -> character map: the bytes that print as
    themselves keep their character, the others (controls, space, ...) take
    the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    spelling = {byte: chr(byte) for byte in kept}
    others = (byte for byte in range(256) if byte not in spelling)
    spelling.update((byte, chr(256 + n)) for n, byte in enumerate(others))
    return dict(sorted(spelling.items()))


def builds_natively(header: GGUFHeader) -> bool:
    """Whether this file's tokenizer is one build_backend makes."""
    return header.metadata.get("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.merges" in header.metadata


def build_backend(header: GGUFHeader):
    """The tokenizers.Tokenizer of a byte-level BPE GGUF (builds_natively):
    the header must hold the tokens and merges as lists."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    meta = header.metadata
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or ()
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    # A token already in the byte alphabet is its own spelling; any other is
    # spelled from its UTF-8 bytes. A repeated spelling keeps its last id.
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
             for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
    del vocab, merges
    pattern = SPLIT_PATTERNS.get(meta.get("tokenizer.ggml.pre"))
    if pattern is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(_GPT2_DEFAULT_SPECIAL, normalized=False, special=True)])
    # Control tokens stay whole and are special; one spelled outside the byte
    # alphabet is a mislabelled ordinary token in llama.cpp's conversion and
    # would grow the vocabulary past the model's, so it is left out.
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token, kind in zip(tokens, types) if kind == _CONTROL and set(token) <= alphabet])
    # User-defined tokens (e.g. <think>) also stay whole but are not special.
    known = backend.get_vocab()
    backend.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, kind in zip(tokens, types) if kind == _USER_DEFINED and token in known])
    return backend


def tokenizer_settings(header: GGUFHeader) -> dict:
    """The tokenizer's settings the file states: chat template, whether to add
    BOS/EOS, and the special tokens by their text (None where absent)."""
    meta = header.metadata
    settings = {name: meta[key] for key, name in (("tokenizer.chat_template", "chat_template"),
                                                   ("tokenizer.ggml.add_bos_token", "add_bos_token"),
                                                   ("tokenizer.ggml.add_eos_token", "add_eos_token")) if key in meta}
    tokens = meta["tokenizer.ggml.tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(f"{header.path}: tokenizer.ggml.{key}={token_id} is outside the {len(tokens)} tokens")
        settings[name] = tokens[token_id] if token_id is not None else None
    return settings


def tokenizer_class(model_type: str):
    """The tokenizer class transformers picks for a model type, from its
    table of class names: importing the tokenizer class alone, not the
    model's config class (which AutoTokenizer's mapping by config class
    would import, and with it sympy and torch.distributed.tensor)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    return tokenizer_class_from_name(name) if name else TokenizersBackend


def load_gguf_tokenizer(path: str | Path, hf_config):
    """The tokenizer of the GGUF file at `path` whose config is `hf_config`
    (the class transformers picks for that config's model type)."""
    path = Path(path)
    header = read_gguf_header(str(path), _STRING_ARRAYS)
    if not builds_natively(header):
        from transformers import AutoTokenizer

        logger.info("GGUF tokenizer model %r: built by transformers", header.metadata.get("tokenizer.ggml.model"))
        del header
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    backend = build_backend(header)
    settings = tokenizer_settings(header)
    del header  # the token and merge lists, before the class copies the backend
    tokenizer = tokenizer_class(hf_config.model_type)(tokenizer_object=backend, name_or_path=str(path.parent),
                                                      **settings)
    del backend  # the class keeps a copy
    return_freed_heap()
    return tokenizer
