"""Shared fixtures: a small byte-level BPE tokenizer trained here (no
downloads), whose merges leave many multi-byte characters split over tokens."""

import pytest

CORPUS = [
    "héllo wörld, hello world! héllo again.",
    "世界 你好 世界 🙂 😀 🙂 naïve café",
    "The quick brown fox jumps over the lazy dog. STOP here; ### end",
    "Ünïcödé tëxt with àccents and 日本語 テキスト 🚀 rockets",
] * 5
SPECIAL = ["<eos>", "<pad>", "<sep>"]


@pytest.fixture(scope="session")
def hf_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   additional_special_tokens=["<sep>"])


@pytest.fixture(scope="session")
def sp_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace "▁", byte fallback <0xNN>,
    leading space stripped by the decoder), as Llama/Mistral ship: decoding a
    lone token loses its leading space, so context matters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = [("▁", "w"), ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d"), ("h", "e"), ("l", "l"),
              ("he", "ll"), ("hell", "o"), ("▁", "hello")]
    for piece in list("▁helowrdé") + [a + b for a, b in merges]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory, hf_tokenizer):
    """make_checkpoint(family) -> (HF model, folder): a tiny random checkpoint
    (tests/models/checkpoints.py) saved with the test tokenizer."""
    from checkpoints import build_hf_model, save_checkpoint

    def make(name: str):
        model = build_hf_model(name)
        folder = str(tmp_path_factory.mktemp(name))
        save_checkpoint(model, folder)
        hf_tokenizer.save_pretrained(folder)
        return model, folder

    return make
