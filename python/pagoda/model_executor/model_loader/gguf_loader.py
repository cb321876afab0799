"""GGUF files (llama.cpp): tensors renamed to Hugging Face's names and
dequantized one at a time to the model's dtype, or (packed=True) matrices in
the block formats our CPU kernels multiply (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)
kept as they are in the file, as PackedWeight rows of blocks.

The config and tokenizer of a GGUF model come from the file's metadata
(pagoda/transformers_utils), the tensor table from its gguf_reader.

Under tensor parallelism every rank reads and dequantizes whole tensors and
the weight_loaders narrow them to the rank's slice: each rank pays for the
whole dequantization, acceptable for the small quantized models GGUF carries.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from pagoda import ops
from pagoda.logger import init_logger
from pagoda.model_executor.layers.rotary_embedding import rope_parameters_from_config
from pagoda.model_executor.weight_utils import PackedWeight
from pagoda.transformers_utils.gguf_reader import read_gguf_header

logger = init_logger(__name__)

# Architectures whose tensors use the names below; llama.cpp also writes
# Mistral-style models as "llama".
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    base, suffix = name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    elif base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no known Hugging Face name")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert_hf_to_gguf permute(): within each head it
    stored the rows as (interleaved pairs) instead of Hugging Face's halves."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# GGML type ids the packed kernels take (ops.gguf_linear).
PACKED_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
# Tensors the model fuses into one parameter: packed only if all share a type.
_FUSED_PARTS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def _packable(tensors: list[_TensorInfo]) -> set[str]:
    """Names of the 2-D tensors to keep packed: a packed type whose row length
    is a whole number of its blocks, and the same type as the other parts of
    their fused parameter."""
    tensors = [t for t in tensors if len(t.shape) == 2]
    types = {t.name: t.tensor_type.name for t in tensors}
    names = set()
    for t in tensors:
        kind = t.tensor_type.name
        if kind not in PACKED_TYPES:
            continue
        # GGUF's writers keep rows whole blocks (llama.cpp quantizes a row of
        # 576 to Q5_0 rather than Q4_K); a file that does not is still read
        # by dequantizing, not handed to the kernels, which refuse it.
        block = ops.GGUF_BLOCKS[PACKED_TYPES[kind]][0]
        if t.shape[1] % block:
            logger.warning("GGUF tensor %s: %s rows of %d weights are not whole blocks of %d: dequantized at load",
                           t.name, kind, t.shape[1], block)
            continue
        names.add(t.name)
    for name in list(names):
        parts = name.split(".")  # blk.3.attn_q.weight
        for group in _FUSED_PARTS:
            if parts[0] == "blk" and parts[2] in group:
                kinds = {types.get(".".join([*parts[:2], sibling, *parts[3:]])) for sibling in group}
                if len(kinds) > 1:
                    names.discard(name)
    dequantized = Counter(kind for name, kind in types.items() if name not in names)
    logger.info("GGUF matrices kept packed: %s; dequantized at load: %s",
                dict(Counter(types[name] for name in names)) or "none", dict(dequantized) or "none")
    return names


def gguf_weights_iterator(
    path: str, hf_config, dtype: torch.dtype, packed: bool = False
) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    import gguf  # imported here: only GGUF loading needs it

    header = read_gguf_header(path)
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} of {path} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    tensors = []
    for t in header.tensors:
        try:
            kind = gguf.GGMLQuantizationType(t.ggml_type)
        except ValueError:
            raise ValueError(f"GGUF tensor {t.name!r} of {path} has unknown ggml type {t.ggml_type}") from None
        tensors.append(_TensorInfo(t.name, kind, t.shape, gguf.quant_shape_to_byte_shape(t.shape, kind), t.offset))
    del header
    keep_packed = _packable(tensors) if packed else set()
    # Each tensor is read from the file into memory of its own rather than
    # viewed through a map of the file, whose touched pages would count too.
    with open(path, "rb") as file:
        for tensor in tensors:
            yield from _load_tensor(file, tensor, hf_config, arch, num_heads, num_kv_heads, dtype,
                                    tensor.name in keep_packed)


class _TensorInfo(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    byte_shape: tuple[int, ...]  # its bytes by rows: [rows, row bytes] for the block types
    offset: int  # of its data in the file


def _read(file, tensor: _TensorInfo) -> np.ndarray:
    """The tensor's bytes, uint8 in byte_shape."""
    data = np.empty(tensor.byte_shape, dtype=np.uint8)
    file.seek(tensor.offset)
    if file.readinto(memoryview(data).cast("B")) != data.nbytes:
        raise ValueError(f"{file.name}: GGUF tensor {tensor.name!r} runs past the end of the file")
    return data


def _load_tensor(file, tensor: _TensorInfo, hf_config, arch: str, num_heads: int, num_kv_heads: int,
                 dtype: torch.dtype, packed: bool) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    import gguf

    if tensor.name == "rope_freqs.weight":
        # Llama 3.1's rope scaling as per-frequency divisors; our RoPE
        # computes them from the config, which must then say llama3.
        _, scaling, _ = rope_parameters_from_config(hf_config)
        if not scaling or scaling.get("rope_type") != "llama3":
            raise ValueError(
                f"{file.name} carries rope_freqs (Llama 3.1 rope scaling) but the config has no llama3 rope "
                "scaling; pass a config with rope_scaling={'rope_type': 'llama3', ...}"
            )
        return
    name = gguf_to_hf_name(tensor.name)
    is_qk = arch == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name)
    heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
    if packed:
        blocks = torch.from_numpy(_read(file, tensor))  # uint8 [rows, row bytes]
        if is_qk:
            blocks = unpermute_qk(blocks, heads)
        yield name, PackedWeight(blocks, PACKED_TYPES[tensor.tensor_type.name], tensor.shape)
        return
    try:
        data = gguf.quants.dequantize(_read(file, tensor), tensor.tensor_type)  # float32 numpy
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} uses quantization type {tensor.tensor_type.name}, "
            "which cannot be dequantized"
        ) from None
    weight = torch.from_numpy(np.asarray(data, dtype=np.float32).reshape(tensor.shape))
    if is_qk:
        weight = unpermute_qk(weight, heads)
    yield name, weight.to(dtype)
