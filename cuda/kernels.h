// GPU kernels: raw device pointers, element strides and a stream in; no torch
// headers, so the same sources build with nvcc (CUDA) and hipcc (ROCm, through
// cuda/portability.h). Each launcher returns the launch's error code so that the
// C++ glue can turn it into a Python exception.
//
// Semantics match cc/cpu/kernels.h exactly (same argument names and layout).
#pragma once

#include <cstdint>

#include "cc/dtype.h"
#include "cuda/portability.h"

namespace pagoda {
namespace gpu {

cudaError_t rms_norm(void* out, int64_t out_stride, const void* x,
                     int64_t x_stride, const void* weight, int64_t num_tokens,
                     int64_t hidden, float eps, DType dtype,
                     cudaStream_t stream);

cudaError_t fused_add_rms_norm(void* x, int64_t x_stride, void* residual,
                               int64_t residual_stride, const void* weight,
                               int64_t num_tokens, int64_t hidden, float eps,
                               DType dtype, cudaStream_t stream);

cudaError_t silu_and_mul(void* out, int64_t out_stride, const void* x,
                         int64_t x_stride, int64_t num_tokens, int64_t d,
                         DType dtype, cudaStream_t stream);

cudaError_t rotary_embedding(const int64_t* positions, void* query,
                             int64_t query_stride, void* key,
                             int64_t key_stride, int64_t num_tokens,
                             int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_size, const void* cos_sin_cache,
                             int64_t rot_dim, bool is_neox, DType dtype,
                             DType cache_dtype, cudaStream_t stream);

}  // namespace gpu
}  // namespace pagoda
