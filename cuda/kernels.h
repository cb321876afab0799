// GPU kernels: raw device pointers, element strides and a stream in; no torch
// headers, so the same sources build with nvcc (CUDA) and hipcc (ROCm, through
// cuda/portability.h). Each launcher returns the launch's error code so that the
// C++ glue can turn it into a Python exception.
//
// Semantics match cc/cpu/kernels.h exactly (same argument names and layout).
#pragma once

#include <cstdint>

#include "cc/dtype.h"
#include "cc/paged_attention_params.h"
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

// Paged KV cache write (cc/cpu/kernels.h). Slots are not checked on the host:
// tokens whose slot is negative (padding) or >= num_slots are skipped.
cudaError_t reshape_and_cache(const void* key, int64_t key_stride,
                              const void* value, int64_t value_stride,
                              void* key_cache, void* value_cache,
                              const int64_t* slot_mapping, int64_t num_tokens,
                              int64_t num_slots, int64_t row_width,
                              DType dtype, bool to_fp8, cudaStream_t stream);

// rope_and_cache (python/pagoda/ops.py): per-head RMSNorm of query and key
// (each only where its weight is non-null), rotary embedding in place, and
// key/value into their cache slots, in one launch (cuda/rope_and_cache.cu).
// query/key/value: rows of heads * head_size elements, *_stride apart;
// caches as reshape_and_cache's, num_slots = num_blocks * block_size.
struct RopeAndCacheParams {
  const int64_t* positions;
  void* query;
  int64_t query_stride;
  void* key;
  int64_t key_stride;
  const void* value;
  int64_t value_stride;
  int64_t num_tokens, num_heads, num_kv_heads, head_size;
  const void* cos_sin_cache;  // [max_position, rot_dim]
  int64_t rot_dim;
  const void* q_norm_weight;  // [head_size] or null
  const void* k_norm_weight;  // [head_size] or null
  float eps;
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;
  int64_t num_slots;
};

// The largest head rope_and_cache takes: each warp of a block keeps one head
// in shared memory (32 KB at this size, under the 48 KB a launch gets
// without opting in to more).
constexpr int64_t kRopeAndCacheMaxHeadSize = 1024;

cudaError_t rope_and_cache(const RopeAndCacheParams& p, bool is_neox,
                           DType dtype, DType cos_sin_dtype, bool to_fp8,
                           cudaStream_t stream);

// How paged_attention splits its work (cuda/attention.cu), decided from
// shapes alone -- tensor sizes, the device's multiprocessor count and compute
// capability -- never from device values, so a CUDA graph that captured the
// launch stays valid when seq_lens, block_tables or query_start_loc change.
struct PagedAttentionPlan {
  int32_t kernel;            // which attention kernel runs
  int32_t heads_per_cta;     // query heads one CTA serves
  int64_t num_partitions;    // key ranges per query token (1: no split)
  int64_t partition_size;    // keys per range
  int64_t workspace_floats;  // fp32 scratch paged_attention needs (0: none)
  const char* error;         // non-null: these shapes are not supported
};

PagedAttentionPlan plan_paged_attention(const PagedAttentionParams& p,
                                        int multiprocessor_count,
                                        int compute_capability_major);

// Causal attention of new tokens over a paged KV cache (see
// PagedAttentionParams): `plan` from plan_paged_attention(p, ...), `workspace`
// plan.workspace_floats floats of device memory (may be null when that is 0).
// Device values are never read on the host; bad metadata gives wrong results
// but no out-of-bounds access.
cudaError_t paged_attention(const PagedAttentionParams& p,
                            const PagedAttentionPlan& plan, float* workspace,
                            cudaStream_t stream);

// The largest vocabulary sample() takes: it sums probability mass in 64-bit
// integers of 2^-40.
constexpr int64_t kSampleMaxVocab = (int64_t{1} << 24) - 1;

// One token id per row of logits (num_rows x vocab_size, row stride
// logits_stride) into out_ids, as Sampler._sample chooses it (cuda/sampling.cu
// says how). Per row: temperature (0: greedy), seeds and offsets (the random
// stream); top_k (int64, 0 = off), top_p (1 = off) and min_p (0 = off) may be
// null (off for every row).
cudaError_t sample(int64_t* out_ids, const void* logits, int64_t logits_stride,
                   int64_t num_rows, int64_t vocab_size, DType dtype,
                   const float* temperature, const int64_t* top_k,
                   const float* top_p, const float* min_p,
                   const int64_t* seeds, const int64_t* offsets,
                   cudaStream_t stream);

}  // namespace gpu
}  // namespace pagoda
