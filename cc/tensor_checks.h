// Argument checking shared by the CPU, CUDA and Meta implementations of the
// torch.ops.pagoda.* ops: validates tensors and turns them into the raw
// pointers, strides and sizes the kernels take. Bad input raises TypeError or
// ValueError in Python (TORCH_CHECK_TYPE / TORCH_CHECK_VALUE), never a crash.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "cc/dtype.h"

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
  TORCH_CHECK_VALUE(out.sizes() == input.sizes(), "out has shape ", out.sizes(), " but input has shape ",
                    input.sizes());
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
  TORCH_CHECK_VALUE(residual.sizes() == input.sizes(), "residual has shape ", residual.sizes(),
                    " but input has shape ", input.sizes());
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

}  // namespace pagoda
