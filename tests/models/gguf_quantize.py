"""K-quant writers for test files (the gguf package dequantizes Q4_K and Q6_K
but does not quantize them): plain round-to-nearest quantizers written from
the format (ggml-quants' block layouts), not llama.cpp's error-minimizing
ones, and a GGUF copied with some tensors requantized."""

from __future__ import annotations

import gguf
import numpy as np


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _steps(scale: np.ndarray, d: np.ndarray, top: int) -> np.ndarray:
    """round(scale / d) in [0, top] (0 where d is 0)."""
    return np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)), 0, top)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> Q4_K blocks uint8 [rows, k / 256 * 144]:
    per super-block fp16 d, dmin; per sub-block of 32 a 6-bit scale sc and
    minimum m (x = d sc q - dmin m); 4-bit quants."""
    rows = x.shape[0]
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(-1), 0)
    scale, minimum = (sub.max(-1) - low) / 15, -low
    d = _fp16(scale.max(-1) / 63).astype(np.float32)
    dmin = _fp16(minimum.max(-1) / 63).astype(np.float32)
    sc, m = _steps(scale, d[:, None], 63), _steps(minimum, dmin[:, None], 63)
    step = (d[:, None] * sc)[..., None]
    shifted = sub + (dmin[:, None] * m)[..., None]
    q = np.clip(np.round(np.divide(shifted, step, out=np.zeros_like(sub), where=step > 0)), 0, 15).astype(np.uint8)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
    ], axis=-1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c, 2c + 1 in bytes 32c..
    blocks = np.concatenate([_fp16(d).view(np.uint8).reshape(-1, 2), _fp16(dmin).view(np.uint8).reshape(-1, 2),
                             scales, qs], axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> Q6_K blocks uint8 [rows, k / 256 * 210]:
    6-bit quants (x = d sc (q - 32)), an int8 scale sc per 16 values, fp16 d."""
    rows = x.shape[0]
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31
    d = _fp16(scale.max(-1) / 127).astype(np.float32)
    sc = _steps(scale, d[:, None], 127)
    step = (d[:, None] * sc)[..., None]
    q = np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half h, t, i]: element 128h + 32t + i
    ql = (q[:, :, [0, 1]] & 15) | ((q[:, :, [2, 3]] & 15) << 4)  # [block, h, t % 2, i]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                             _fp16(d).view(np.uint8).reshape(-1, 2)], axis=-1)
    return blocks.reshape(rows, -1)


QUANTIZERS = {gguf.GGMLQuantizationType.Q4_K: quantize_q4_k, gguf.GGMLQuantizationType.Q6_K: quantize_q6_k}


def requantize(source: str, destination: str, types: dict[str, gguf.GGMLQuantizationType]) -> None:
    """source's metadata and tensors into destination, the tensors named in
    types dequantized and quantized again to their K-quant there."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(destination, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer's own
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    for tensor in reader.tensors:
        data, kind = tensor.data, tensor.tensor_type
        if tensor.name in types:
            values = gguf.quants.dequantize(data, kind).reshape(-1, int(tensor.shape[0]))
            kind = types[tensor.name]
            data = QUANTIZERS[kind](values)
        writer.add_tensor(tensor.name, np.ascontiguousarray(data), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
