"""The divisibility rule of tensor parallelism, in plain Python (no torch), so
that the engine can refuse a configuration before it spawns any worker; the
models check the same rule at construction."""

from __future__ import annotations


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def num_kv_heads_per_rank(total_num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each rank holds: its share, or 1 (replicated) when there are
    fewer KV heads than ranks and they divide the ranks."""
    tp = tensor_parallel_size
    if (total_num_kv_heads % tp) if total_num_kv_heads >= tp else (tp % total_num_kv_heads):
        raise ValueError(f"num_key_value_heads ({total_num_kv_heads}) must be a multiple or a divisor of "
                         f"tensor_parallel_size ({tp})")
    return max(1, total_num_kv_heads // tp)


def verify_tensor_parallel(hf_config, tensor_parallel_size: int) -> None:
    """Raises ValueError, naming the config field and the values, unless every
    dimension that tensor parallelism splits divides among tensor_parallel_size
    ranks: query heads, the MLP's intermediate size (intermediate_size, or
    OPT's ffn_dim), and KV heads -- which may also be fewer than the ranks if
    they divide them (each KV head is then replicated on several ranks).
    hidden_size is never split (embeddings split the vocabulary, padded to
    divide), so it needs no check."""
    tp = tensor_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    num_heads = hf_config.num_attention_heads
    if num_heads % tp:
        raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size ({tp})")
    num_kv_heads_per_rank(getattr(hf_config, "num_key_value_heads", None) or num_heads, tp)
    field = "intermediate_size" if getattr(hf_config, "intermediate_size", None) is not None else "ffn_dim"
    size = getattr(hf_config, field, None)
    if size is not None and size % tp:
        raise ValueError(f"{field} ({size}) is not divisible by tensor_parallel_size ({tp})")
