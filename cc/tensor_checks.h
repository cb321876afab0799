// Argument checking shared by the CPU, CUDA and Meta implementations of the
// torch.ops.pagoda.* ops: validates tensors and turns them into the raw
// pointers, strides and sizes the kernels take. Bad input raises TypeError or
// ValueError in Python (TORCH_CHECK_TYPE / TORCH_CHECK_VALUE), never a crash.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "cc/dtype.h"
#include "cc/paged_attention_params.h"

namespace pagoda {

inline DType kernel_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

inline void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), name, " has dtype ", t.scalar_type(), " but ", ref_name,
                   " has ", ref.scalar_type(), "; they must match");
}

inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ",
                    ref.device(), "; all arguments must be on one device");
}

inline void check_same_shape(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), name, " has shape ", t.sizes(), " but ", ref_name, " has shape ",
                    ref.sizes());
}

// A tensor seen as rows of `width` contiguous elements: [..., width] whose
// leading dimensions collapse into one with a single row stride.
struct Rows {
  void* data;
  int64_t stride;
  int64_t count;
  int64_t width;
};

inline Rows as_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() >= 1, name, " must have at least one dimension");
  const int64_t width = t.size(-1);
  TORCH_CHECK_VALUE(t.stride(-1) == 1 || width <= 1, name, " must be contiguous in its last dimension (stride ",
                    t.stride(-1), ")");
  int64_t count = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) count *= t.size(d);
  int64_t stride = width;
  if (t.dim() >= 2) {
    stride = t.stride(-2);
    // Leading dimensions must collapse: each stride equals the next size x stride.
    for (int64_t d = t.dim() - 3; d >= 0; --d) {
      TORCH_CHECK_VALUE(t.size(d) <= 1 || t.stride(d) == t.stride(d + 1) * t.size(d + 1), name,
                        " has leading dimensions that cannot be viewed as one row dimension (sizes ", t.sizes(),
                        ", strides ", t.strides(), "); pass a contiguous tensor");
    }
  }
  return Rows{t.data_ptr(), stride, count, width};
}

inline void check_float_op(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  check_same_device(t, name, ref, ref_name);
  check_same_dtype(t, name, ref, ref_name);
}

struct RmsNormArgs {
  Rows out, input;
  const void* weight;
  DType dtype;
};

inline RmsNormArgs check_rms_norm(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight) {
  const DType dtype = kernel_dtype(input, "input");
  check_float_op(out, "out", input, "input");
  check_float_op(weight, "weight", input, "input");
  check_same_shape(out, "out", input, "input");
  Rows in_rows = as_rows(input, "input");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == in_rows.width && weight.is_contiguous(),
                    "weight must be a contiguous 1-D tensor of the hidden size ", in_rows.width, ", got shape ",
                    weight.sizes());
  return RmsNormArgs{as_rows(out, "out"), in_rows, weight.data_ptr(), dtype};
}

struct FusedAddRmsNormArgs {
  Rows input, residual;
  const void* weight;
  DType dtype;
};

inline FusedAddRmsNormArgs check_fused_add_rms_norm(const at::Tensor& input, const at::Tensor& residual,
                                                    const at::Tensor& weight) {
  const DType dtype = kernel_dtype(input, "input");
  check_float_op(residual, "residual", input, "input");
  check_float_op(weight, "weight", input, "input");
  check_same_shape(residual, "residual", input, "input");
  Rows in_rows = as_rows(input, "input");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == in_rows.width && weight.is_contiguous(),
                    "weight must be a contiguous 1-D tensor of the hidden size ", in_rows.width, ", got shape ",
                    weight.sizes());
  return FusedAddRmsNormArgs{in_rows, as_rows(residual, "residual"), weight.data_ptr(), dtype};
}

struct SiluAndMulArgs {
  Rows out, input;
  DType dtype;
};

inline SiluAndMulArgs check_silu_and_mul(const at::Tensor& out, const at::Tensor& input) {
  const DType dtype = kernel_dtype(input, "input");
  check_float_op(out, "out", input, "input");
  Rows in_rows = as_rows(input, "input");
  Rows out_rows = as_rows(out, "out");
  TORCH_CHECK_VALUE(in_rows.width % 2 == 0, "input's last dimension (", in_rows.width,
                    ") must be even: [gate | up]");
  TORCH_CHECK_VALUE(out.dim() == input.dim() && out_rows.count == in_rows.count &&
                        out_rows.width * 2 == in_rows.width,
                    "out must have input's shape with the last dimension halved; out ", out.sizes(), ", input ",
                    input.sizes());
  return SiluAndMulArgs{out_rows, in_rows, dtype};
}

struct RotaryArgs {
  const int64_t* positions;
  Rows query;
  void* key;
  int64_t key_stride;
  int64_t num_tokens, num_heads, num_kv_heads, head_size;
  const void* cos_sin_cache;
  int64_t rot_dim;
  int64_t max_position;
  DType dtype, cache_dtype;
};

inline RotaryArgs check_rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                         const c10::optional<at::Tensor>& key, int64_t head_size,
                                         const at::Tensor& cos_sin_cache) {
  const DType dtype = kernel_dtype(query, "query");
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong, "positions must be int64, got ", positions.scalar_type());
  check_same_device(positions, "positions", query, "query");
  check_same_device(cos_sin_cache, "cos_sin_cache", query, "query");
  TORCH_CHECK_TYPE(cos_sin_cache.scalar_type() == query.scalar_type() || cos_sin_cache.scalar_type() == at::kFloat,
                   "cos_sin_cache must be float32 or query's dtype ", query.scalar_type(), ", got ",
                   cos_sin_cache.scalar_type());
  const DType cache_dtype = kernel_dtype(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK_VALUE(head_size > 0, "head_size must be positive, got ", head_size);
  TORCH_CHECK_VALUE(positions.is_contiguous(), "positions must be contiguous");
  const int64_t num_tokens = positions.numel();
  TORCH_CHECK_VALUE(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous(),
                    "cos_sin_cache must be a contiguous [max_position, rot_dim] tensor, got shape ",
                    cos_sin_cache.sizes());
  const int64_t rot_dim = cos_sin_cache.size(1);
  TORCH_CHECK_VALUE(rot_dim % 2 == 0 && rot_dim > 0 && rot_dim <= head_size, "cos_sin_cache's rot_dim (", rot_dim,
                    ") must be even and in (0, head_size=", head_size, "]");

  // query/key: [num_tokens, heads * head_size] or [num_tokens, heads, head_size]
  // (or with [batch, seq] leading dimensions matching positions).
  auto token_rows = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.numel() % (num_tokens == 0 ? 1 : num_tokens) == 0, name, " has ", t.numel(),
                      " elements, not a multiple of the ", num_tokens, " positions");
    TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
    at::Tensor flat = t.dim() == positions.dim() + 1 ? t : t.flatten(positions.dim());
    TORCH_CHECK_VALUE(flat.is_alias_of(t) || t.numel() == 0, name, " could not be viewed without a copy");
    Rows rows = as_rows(flat, name);
    TORCH_CHECK_VALUE(rows.count == num_tokens, name, " has ", rows.count, " tokens but positions has ", num_tokens);
    TORCH_CHECK_VALUE(rows.width % head_size == 0, name, "'s token width ", rows.width,
                      " is not a multiple of head_size ", head_size);
    return rows;
  };
  Rows q = token_rows(query, "query");
  void* key_ptr = nullptr;
  int64_t key_stride = 0, num_kv_heads = 0;
  if (key.has_value()) {
    check_same_device(*key, "key", query, "query");
    check_same_dtype(*key, "key", query, "query");
    Rows k = token_rows(*key, "key");
    key_ptr = k.data;
    key_stride = k.stride;
    num_kv_heads = k.width / head_size;
  }
  return RotaryArgs{positions.data_ptr<int64_t>(), q, key_ptr, key_stride, num_tokens, q.width / head_size,
                    num_kv_heads, head_size, cos_sin_cache.data_ptr(), rot_dim, cos_sin_cache.size(0), dtype,
                    cache_dtype};
}


// A linear layer's out: input's shape with the last dimension N.
inline Rows check_linear_out(const at::Tensor& out, const at::Tensor& input, int64_t N) {
  TORCH_CHECK_VALUE(out.dim() == input.dim() && out.sizes().slice(0, out.dim() - 1) == input.sizes().slice(0, input.dim() - 1) &&
                        out.size(-1) == N,
                    "out must have shape ", input.sizes().slice(0, input.dim() - 1), " + [", N, "], got ", out.sizes());
  return as_rows(out, "out");
}

// A linear layer's optional bias: [N], input's dtype and device; null if none.
inline const void* check_linear_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& input, int64_t N) {
  if (!bias.has_value()) return nullptr;
  check_float_op(*bias, "bias", input, "input");
  TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                    "bias must be a contiguous 1-D tensor of out_features = ", N, " elements, got shape ", bias->sizes());
  return bias->data_ptr();
}

struct LinearArgs {
  Rows out, input;  // M rows of N / K elements
  const void* weight;  // [N, K] contiguous
  const void* bias;    // [N] or null
  int64_t M, N, K;
  DType dtype;
};

// out[..., N] = input[..., K] @ weight[N, K]^T (+ bias[N]); input and out
// rows may be strided (last dimension contiguous).
inline LinearArgs check_linear(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& bias) {
  const DType dtype = kernel_dtype(input, "input");
  check_float_op(weight, "weight", input, "input");
  check_float_op(out, "out", input, "input");
  TORCH_CHECK_VALUE(weight.dim() == 2, "weight must be 2-D [out_features, in_features], got shape ", weight.sizes());
  TORCH_CHECK_VALUE(weight.is_contiguous(), "weight must be contiguous (strides ", weight.strides(), ")");
  const int64_t N = weight.size(0), K = weight.size(1);
  Rows in_rows = as_rows(input, "input");
  TORCH_CHECK_VALUE(in_rows.width == K, "input's last dimension (", in_rows.width, ") must equal weight's in_features (",
                    K, "); input ", input.sizes(), ", weight ", weight.sizes());
  return LinearArgs{check_linear_out(out, input, N), in_rows, weight.data_ptr(), check_linear_bias(bias, input, N),
                    in_rows.count, N, K, dtype};
}

// GGUF-packed weights (CPU only): uint8 [N, K / values * bytes] in GGUF's
// block layout, weight_type one of GGML's type ids below.
constexpr int64_t kGgufBlock = 32;

struct GgufBlock {
  const char* name;
  int64_t values, bytes;
};

inline GgufBlock gguf_block(int64_t weight_type) {
  switch (weight_type) {
    case 2: return {"Q4_0", kGgufBlock, 18};
    case 3: return {"Q4_1", kGgufBlock, 20};
    case 8: return {"Q8_0", kGgufBlock, 34};
    case 1008: return {"Q8_0 grouped", kGgufBlock, 34};
    case 12: return {"Q4_K", 256, 144};
    case 14: return {"Q6_K", 256, 210};
    default:
      TORCH_CHECK_VALUE(false, "weight_type ", weight_type,
                        " is not a GGUF block format with a kernel here (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, "
                        "Q6_K = 14, Pagoda's Q8_0 grouped = 1008)");
  }
}

// The logical in_features K of a packed weight, from its row bytes.
inline void check_gguf_weight(const at::Tensor& weight, int64_t weight_type, int64_t K) {
  const GgufBlock block = gguf_block(weight_type);
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kByte, "weight must be uint8 (GGUF blocks), got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.is_contiguous(),
                    "weight must be a contiguous 2-D [out_features, row bytes] tensor, got shape ", weight.sizes(),
                    " strides ", weight.strides());
  TORCH_CHECK_VALUE(K % block.values == 0, "in_features (", K, ") must be a multiple of ", block.name,
                    "'s block size ", block.values);
  TORCH_CHECK_VALUE(weight.size(1) == K / block.values * block.bytes, "weight rows hold ", weight.size(1),
                    " bytes but in_features ", K, " needs ", K / block.values, " blocks of ", block.bytes, " bytes");
}

struct GgufLinearArgs {
  Rows out, input;
  const void* weight;
  const float* bias;
  int64_t M, N, K;
};

// out[..., N] = input[..., K] @ dequantize(weight)^T (+ bias); fp32 input,
// out and bias.
inline GgufLinearArgs check_gguf_linear(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                        int64_t weight_type, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_TYPE(input.scalar_type() == at::kFloat, "input must be float32, got ", input.scalar_type());
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "out must be float32, got ", out.scalar_type());
  check_same_device(weight, "weight", input, "input");
  check_same_device(out, "out", input, "input");
  Rows in_rows = as_rows(input, "input");
  check_gguf_weight(weight, weight_type, in_rows.width);
  const int64_t N = weight.size(0), K = in_rows.width;
  return GgufLinearArgs{check_linear_out(out, input, N), in_rows, weight.data_ptr(),
                        static_cast<const float*>(check_linear_bias(bias, input, N)), in_rows.count, N, K};
}

// A [num_tokens, heads, head_size] tensor whose heads are contiguous within a
// token (last two dimensions contiguous; any token stride), e.g. a view of one
// part of a fused qkv projection. Rows are tokens of heads * head_size.
inline Rows as_token_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 3, name, " must be [num_tokens, num_heads, head_size], got shape ", t.sizes());
  TORCH_CHECK_VALUE((t.stride(2) == 1 || t.size(2) <= 1) && (t.stride(1) == t.size(2) || t.size(1) <= 1), name,
                    " must be contiguous in its last two dimensions (strides ", t.strides(), ", sizes ", t.sizes(),
                    "); only the token stride may differ");
  return Rows{t.data_ptr(), t.size(0) <= 1 ? t.size(1) * t.size(2) : t.stride(0), t.size(0), t.size(1) * t.size(2)};
}

// A paged KV cache: [num_blocks, block_size, num_kv_heads, head_size], contiguous.
inline void check_kv_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK_VALUE(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_size], got shape ",
                    cache.sizes());
  TORCH_CHECK_VALUE(cache.size(1) > 0 && cache.size(2) > 0 && cache.size(3) > 0, name,
                    " must have a positive block size, number of kv heads and head size, got shape ", cache.sizes());
  TORCH_CHECK_VALUE(cache.is_contiguous(), name, " must be contiguous (strides ", cache.strides(), ")");
}

// The key and value caches of one layer: each a valid cache, both one shape.
inline void check_kv_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  check_kv_cache(key_cache, "key_cache");
  check_same_shape(value_cache, "value_cache", key_cache, "key_cache");
  check_same_dtype(value_cache, "value_cache", key_cache, "key_cache");
  check_kv_cache(value_cache, "value_cache");
}

// Whether a KV cache holds float8 e4m3 (unit scale; --kv-cache-dtype fp8):
// else it must hold `ref`'s dtype, or bfloat16 beside a float32 `ref`
// (--kv-cache-dtype bfloat16 under an fp32 model: K/V rounded on the write,
// widened on the read; CPU kernels only, cc/cuda_ops.cc refuses it). Only
// bf16/fp16 K/V go to fp8 (the kernels widen it to fp16 for the tensor cores).
inline bool check_kv_cache_dtype(const at::Tensor& cache, const char* name, const at::Tensor& ref,
                                 const char* ref_name) {
  check_same_device(cache, name, ref, ref_name);
  if (cache.scalar_type() != at::kFloat8_e4m3fn) {
    if (!(cache.scalar_type() == at::kBFloat16 && ref.scalar_type() == at::kFloat)) {
      check_same_dtype(cache, name, ref, ref_name);
    }
    return false;
  }
  TORCH_CHECK_TYPE(ref.scalar_type() != at::kFloat, "a float8 ", name, " needs bfloat16 or float16 ", ref_name,
                   ", got float32");
  return true;
}

// A contiguous 1-D index tensor of `size` elements of type `type` (named
// `type_name` in messages).
inline void check_index_vector(const at::Tensor& t, const char* name, at::ScalarType type, const char* type_name,
                               int64_t size, const char* size_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == type, name, " must be ", type_name, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == size, name, " must be a 1-D tensor of ", size_name, " = ", size,
                    " elements, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

struct ReshapeAndCacheArgs {
  Rows key, value;  // one row per token: num_kv_heads * head_size elements
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;
  int64_t num_slots;  // num_blocks * block_size
  DType dtype;        // of key and value
  bool kv_fp8;        // the caches hold float8 e4m3
  DType kv_dtype;     // the caches' dtype unless kv_fp8: dtype, or bf16 under fp32
};

inline ReshapeAndCacheArgs check_reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                                                   const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                   const at::Tensor& slot_mapping) {
  const DType dtype = kernel_dtype(key, "key");
  check_float_op(value, "value", key, "key");
  const bool kv_fp8 = check_kv_cache_dtype(key_cache, "key_cache", key, "key");
  check_same_device(slot_mapping, "slot_mapping", key, "key");
  Rows k = as_token_heads(key, "key");
  check_same_shape(value, "value", key, "key");
  Rows v = as_token_heads(value, "value");
  check_kv_cache_pair(key_cache, value_cache);
  TORCH_CHECK_VALUE(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2), "key_cache holds ",
                    key_cache.size(2), " kv heads of size ", key_cache.size(3), " but key has ", key.size(1),
                    " heads of size ", key.size(2));
  check_index_vector(slot_mapping, "slot_mapping", at::kLong, "int64", k.count, "num_tokens");
  return ReshapeAndCacheArgs{k,
                             v,
                             key_cache.data_ptr(),
                             value_cache.data_ptr(),
                             slot_mapping.data_ptr<int64_t>(),
                             key_cache.size(0) * key_cache.size(1),
                             dtype,
                             kv_fp8,
                             kv_fp8 ? dtype : kernel_dtype(key_cache, "key_cache")};
}

// rope_and_cache: rotary_embedding's and reshape_and_cache's checks on the
// same query/key/value (key and value as [num_tokens, num_kv_heads,
// head_size] views for the cache), plus the optional per-head norm weights.
struct RopeAndCacheArgs {
  RotaryArgs rotary;
  ReshapeAndCacheArgs cache;
  const void* q_norm_weight;  // null: no norm over query heads
  const void* k_norm_weight;  // null: no norm over key heads
};

inline const void* check_head_norm_weight(const c10::optional<at::Tensor>& weight, const char* name,
                                          const at::Tensor& query, int64_t head_size) {
  if (!weight.has_value()) return nullptr;
  check_float_op(*weight, name, query, "query");
  TORCH_CHECK_VALUE(weight->dim() == 1 && weight->size(0) == head_size && weight->is_contiguous(), name,
                    " must be a contiguous 1-D tensor of head_size = ", head_size, " elements, got shape ",
                    weight->sizes());
  return weight->data_ptr();
}

inline RopeAndCacheArgs check_rope_and_cache(const at::Tensor& positions, const at::Tensor& query,
                                             const at::Tensor& key, const at::Tensor& value,
                                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                                             const at::Tensor& slot_mapping, int64_t head_size,
                                             const at::Tensor& cos_sin_cache,
                                             const c10::optional<at::Tensor>& q_norm_weight,
                                             const c10::optional<at::Tensor>& k_norm_weight) {
  TORCH_CHECK_VALUE(positions.dim() == 1, "positions must be 1-D [num_tokens], got shape ", positions.sizes());
  const RotaryArgs rotary = check_rotary_embedding(positions, query, key, head_size, cos_sin_cache);
  check_float_op(value, "value", key, "key");
  const int64_t num_tokens = positions.numel();
  TORCH_CHECK_VALUE(value.numel() == key.numel(), "value has ", value.numel(), " elements but key has ", key.numel());
  const at::Tensor key_heads = key.view({num_tokens, rotary.num_kv_heads, head_size});
  const at::Tensor value_heads = value.view({num_tokens, rotary.num_kv_heads, head_size});
  return RopeAndCacheArgs{rotary,
                          check_reshape_and_cache(key_heads, value_heads, key_cache, value_cache, slot_mapping),
                          check_head_norm_weight(q_norm_weight, "q_norm_weight", query, head_size),
                          check_head_norm_weight(k_norm_weight, "k_norm_weight", query, head_size)};
}

struct PagedAttentionArgs {
  Rows out, query;  // one row per token: num_heads * head_size elements
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  int64_t block_tables_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t num_seqs, num_heads, num_kv_heads, head_size, num_blocks, block_size, max_blocks_per_seq;
  DType dtype;
  bool kv_fp8;
  DType kv_dtype;  // as ReshapeAndCacheArgs'
};

inline PagedAttentionArgs check_paged_attention(const at::Tensor& out, const at::Tensor& query,
                                                const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                const at::Tensor& query_start_loc) {
  const DType dtype = kernel_dtype(query, "query");
  check_float_op(out, "out", query, "query");
  const bool kv_fp8 = check_kv_cache_dtype(key_cache, "key_cache", query, "query");
  check_same_device(block_tables, "block_tables", query, "query");
  check_same_device(seq_lens, "seq_lens", query, "query");
  check_same_device(query_start_loc, "query_start_loc", query, "query");
  Rows q = as_token_heads(query, "query");
  check_same_shape(out, "out", query, "query");
  Rows o = as_token_heads(out, "out");
  check_kv_cache_pair(key_cache, value_cache);
  const int64_t num_heads = query.size(1), head_size = query.size(2), num_kv_heads = key_cache.size(2);
  TORCH_CHECK_VALUE(key_cache.size(3) == head_size, "key_cache's head size is ", key_cache.size(3),
                    " but query's is ", head_size);
  TORCH_CHECK_VALUE(num_heads > 0 && num_heads % num_kv_heads == 0, "query's ", num_heads,
                    " heads must be a positive multiple of the cache's ", num_kv_heads, " kv heads");
  TORCH_CHECK_TYPE(block_tables.scalar_type() == at::kInt, "block_tables must be int32, got ",
                   block_tables.scalar_type());
  TORCH_CHECK_TYPE(seq_lens.scalar_type() == at::kInt, "seq_lens must be int32, got ", seq_lens.scalar_type());
  TORCH_CHECK_VALUE(seq_lens.dim() == 1, "seq_lens must be 1-D [num_seqs], got shape ", seq_lens.sizes());
  const int64_t num_seqs = seq_lens.size(0);
  check_index_vector(seq_lens, "seq_lens", at::kInt, "int32", num_seqs, "num_seqs");
  check_index_vector(query_start_loc, "query_start_loc", at::kInt, "int32", num_seqs + 1, "num_seqs + 1");
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == num_seqs, "block_tables must be [num_seqs=",
                    num_seqs, ", max_blocks_per_seq], got shape ", block_tables.sizes());
  TORCH_CHECK_VALUE(block_tables.stride(1) == 1 || block_tables.size(1) <= 1,
                    "block_tables must be contiguous in its last dimension");
  return PagedAttentionArgs{o,
                            q,
                            key_cache.data_ptr(),
                            value_cache.data_ptr(),
                            block_tables.data_ptr<int32_t>(),
                            block_tables.stride(0),
                            seq_lens.data_ptr<int32_t>(),
                            query_start_loc.data_ptr<int32_t>(),
                            num_seqs,
                            num_heads,
                            num_kv_heads,
                            head_size,
                            key_cache.size(0),
                            key_cache.size(1),
                            block_tables.size(1),
                            dtype,
                            kv_fp8,
                            kv_fp8 ? dtype : kernel_dtype(key_cache, "key_cache")};
}

// What the CPU and GPU kernels take, from checked arguments.
inline PagedAttentionParams paged_attention_params(const PagedAttentionArgs& a, double scale) {
  PagedAttentionParams p;
  p.out = a.out.data;
  p.out_stride = a.out.stride;
  p.query = a.query.data;
  p.query_stride = a.query.stride;
  p.num_tokens = a.query.count;
  p.key_cache = a.key_cache;
  p.value_cache = a.value_cache;
  p.num_blocks = a.num_blocks;
  p.block_tables = a.block_tables;
  p.block_tables_stride = a.block_tables_stride;
  p.max_blocks_per_seq = a.max_blocks_per_seq;
  p.seq_lens = a.seq_lens;
  p.query_start_loc = a.query_start_loc;
  p.num_seqs = a.num_seqs;
  p.num_heads = a.num_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.head_size = a.head_size;
  p.block_size = a.block_size;
  p.scale = static_cast<float>(scale);
  p.dtype = a.dtype;
  p.kv_fp8 = a.kv_fp8;
  p.kv_dtype = a.kv_dtype;
  return p;
}

// The values of paged_attention's metadata: query_start_loc runs from 0 to
// the number of query tokens without decreasing, no sequence has more new
// tokens than tokens, and its block table row covers its tokens with existing
// blocks. Reads the tensors' values: host memory only.
inline void check_paged_attention_metadata(const PagedAttentionArgs& a) {
  const int32_t* qsl = a.query_start_loc;
  TORCH_CHECK_VALUE(qsl[0] == 0, "query_start_loc[0] must be 0, got ", qsl[0]);
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q_len = int64_t{qsl[s + 1]} - qsl[s];
    const int64_t seq_len = a.seq_lens[s];
    TORCH_CHECK_VALUE(q_len >= 0, "query_start_loc must not decrease: query_start_loc[", s + 1, "] = ", qsl[s + 1],
                      " < query_start_loc[", s, "] = ", qsl[s]);
    TORCH_CHECK_VALUE(q_len <= seq_len, "sequence ", s, " has ", q_len, " query tokens but seq_lens[", s, "] = ",
                      seq_len, "; seq_lens counts the new tokens too");
    const int64_t blocks = (seq_len + a.block_size - 1) / a.block_size;
    TORCH_CHECK_VALUE(blocks <= a.max_blocks_per_seq, "sequence ", s, " has ", seq_len, " tokens in ", blocks,
                      " blocks of ", a.block_size, " but block_tables has only ", a.max_blocks_per_seq,
                      " columns");
    const int32_t* row = a.block_tables + s * a.block_tables_stride;
    for (int64_t i = 0; i < blocks; ++i) {
      TORCH_CHECK_VALUE(row[i] >= 0 && row[i] < a.num_blocks, "block_tables[", s, ", ", i, "] = ", row[i],
                        " is outside the cache's [0, ", a.num_blocks, ") blocks");
    }
  }
  TORCH_CHECK_VALUE(qsl[a.num_seqs] == a.query.count, "query_start_loc[", a.num_seqs, "] = ", qsl[a.num_seqs],
                    " but query has ", a.query.count, " tokens");
}

struct SampleArgs {
  Rows logits;  // one row of vocab_size logits per sampled token
  int64_t* out_ids;
  const float* temperature;
  const int64_t* top_k;  // null: off for every row (likewise top_p, min_p)
  const float* top_p;
  const float* min_p;
  const int64_t* seeds;
  const int64_t* offsets;
  DType dtype;
};

// out_ids (int64) gets one token per row of logits [num_rows, vocab_size]; the
// per-row knobs are contiguous 1-D tensors of num_rows elements on logits'
// device: temperature, top_p, min_p float32; top_k, seeds, offsets int64.
inline SampleArgs check_sample(const at::Tensor& out_ids, const at::Tensor& logits, const at::Tensor& temperature,
                               const c10::optional<at::Tensor>& top_k, const c10::optional<at::Tensor>& top_p,
                               const c10::optional<at::Tensor>& min_p, const at::Tensor& seeds,
                               const at::Tensor& offsets) {
  const DType dtype = kernel_dtype(logits, "logits");
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(1) > 0,
                    "logits must be [num_rows, vocab_size] with vocab_size > 0, got shape ", logits.sizes());
  const Rows rows = as_rows(logits, "logits");
  auto per_row = [&](const at::Tensor& t, const char* name, at::ScalarType type, const char* type_name) {
    check_same_device(t, name, logits, "logits");
    check_index_vector(t, name, type, type_name, rows.count, "num_rows");
    return t.data_ptr();
  };
  auto optional_per_row = [&](const c10::optional<at::Tensor>& t, const char* name, at::ScalarType type,
                              const char* type_name) -> const void* {
    return t.has_value() ? per_row(*t, name, type, type_name) : nullptr;
  };
  return SampleArgs{rows,
                    static_cast<int64_t*>(per_row(out_ids, "out_ids", at::kLong, "int64")),
                    static_cast<const float*>(per_row(temperature, "temperature", at::kFloat, "float32")),
                    static_cast<const int64_t*>(optional_per_row(top_k, "top_k", at::kLong, "int64")),
                    static_cast<const float*>(optional_per_row(top_p, "top_p", at::kFloat, "float32")),
                    static_cast<const float*>(optional_per_row(min_p, "min_p", at::kFloat, "float32")),
                    static_cast<const int64_t*>(per_row(seeds, "seeds", at::kLong, "int64")),
                    static_cast<const int64_t*>(per_row(offsets, "offsets", at::kLong, "int64")),
                    dtype};
}

}  // namespace pagoda
