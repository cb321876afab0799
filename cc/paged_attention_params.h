// Arguments of paged_attention, shared by the CPU kernels (cc/cpu) and the GPU
// kernels (cuda/): plain pointers and sizes, no torch headers.
#pragma once

#include <cstdint>

#include "cc/dtype.h"

namespace pagoda {

// The "unified" prefill/decode attention: sequence s owns query rows
// query_start_loc[s] .. query_start_loc[s+1]-1 (its q_len new tokens) and has
// seq_lens[s] tokens in the cache, the new ones included. Its new token j
// (0-based) is at position seq_len - q_len + j and attends to cache positions
// 0 .. that position. Position i of sequence s lives in block
// block_tables[s * block_tables_stride + i / block_size], row i % block_size.
// query head h reads kv head h / (num_heads / num_kv_heads).
// The CPU caller has checked everything: q_len <= seq_len, the block tables
// cover every position and name existing blocks, query_start_loc[num_seqs] is
// the number of query rows. The GPU kernels cannot read device values on the
// host: they only clamp what they read so that bad values give a wrong result,
// never an access out of bounds.
struct PagedAttentionParams {
  // [num_tokens, num_heads, head_size]: rows of num_heads * head_size
  // contiguous elements, out_stride / query_stride elements apart.
  void* out;
  int64_t out_stride;
  const void* query;
  int64_t query_stride;
  int64_t num_tokens;
  // [num_blocks, block_size, num_kv_heads, head_size], contiguous.
  const void* key_cache;
  const void* value_cache;
  int64_t num_blocks;
  // [num_seqs, max_blocks_per_seq] (>= blocks used), rows strided.
  const int32_t* block_tables;
  int64_t block_tables_stride;
  int64_t max_blocks_per_seq;
  const int32_t* seq_lens;         // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1]
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  float scale;  // softmax(scale * q.k)
  DType dtype;  // of out and query
  // The caches hold float8 e4m3 with unit scale (GPU tensor-core kernel only).
  bool kv_fp8 = false;
  // Else the caches' dtype: dtype, or bf16 under fp32 queries (CPU only).
  DType kv_dtype;
};

}  // namespace pagoda
