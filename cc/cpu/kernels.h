// CPU kernels. Each source is compiled once per instruction set (AVX2+FMA,
// AVX512F/BW/VL); PAGODA_CPU_NS names the namespace of one such build so that
// both builds link into one library and cc/cpu_dispatch.cc picks one at load time.
// Code for later extensions (AVX512_BF16, AVX512_VNNI) is compiled into the
// AVX512 build under `#pragma GCC target` and chosen at run time from cpuid.
//
// Conventions: pointers are to the first element; "stride" arguments are in
// elements between consecutive tokens (rows); within a row elements are
// contiguous. All arithmetic is done in fp32.
//
// Rounding to the dtype follows Hugging Face on tensors of that dtype:
//   rms_norm: out = round(weight * round(x * rsqrt(mean(x^2) + eps))), with
//     weight in the same dtype as x and rsqrt = 1/sqrtf;
//   fused_add_rms_norm: residual = round(x + residual), then x = rms_norm of
//     that rounded residual;
//   silu_and_mul: out = round(round(silu(gate)) * up);
//   rotary_embedding: each output rounded once.
//   paged_attention: softmax and the weighted sum of values in fp32 (q is
//     converted to fp32 and multiplied by scale first); out rounded once.
//     The caches hold the query's dtype, or bf16 under fp32 queries (a 16-bit
//     KV cache for an fp32 model: K/V widened exactly on the read).
// rms_norm may run in place (out == x with out_stride == x_stride); no other
// overlap between inputs and outputs is supported.
#pragma once

#include <cstdint>

#include "cc/dtype.h"
#include "cc/paged_attention_params.h"

#define PAGODA_CPU_KERNEL_DECLS                                                  \
  /* out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * weight */                       \
  void rms_norm(void* out, int64_t out_stride, const void* x, int64_t x_stride,  \
                const void* weight, int64_t num_tokens, int64_t hidden,          \
                float eps, DType dtype);                                         \
  /* residual[t] += x[t]; x[t] = rms_norm(residual[t]) * weight (in place) */    \
  void fused_add_rms_norm(void* x, int64_t x_stride, void* residual,             \
                          int64_t residual_stride, const void* weight,           \
                          int64_t num_tokens, int64_t hidden, float eps,         \
                          DType dtype);                                          \
  /* x[t] = [gate (d) | up (d)]; out[t] = silu(gate) * up */                     \
  void silu_and_mul(void* out, int64_t out_stride, const void* x,                \
                    int64_t x_stride, int64_t num_tokens, int64_t d,             \
                    DType dtype);                                                \
  /* In place on query [T, num_heads, head_size] and key [T, num_kv_heads,       \
     head_size] (key may be null). cos_sin_cache is [max_position, rot_dim]:     \
     rot_dim/2 cos values then rot_dim/2 sin values, in cache_dtype (the query   \
     dtype or fp32). The first rot_dim elements of each head rotate: NeoX style  \
     pairs (i, i + rot_dim/2), GPT-J style pairs (2i, 2i + 1). */                \
  void rotary_embedding(const int64_t* positions, void* query,                   \
                        int64_t query_stride, void* key, int64_t key_stride,     \
                        int64_t num_tokens, int64_t num_heads,                   \
                        int64_t num_kv_heads, int64_t head_size,                 \
                        const void* cos_sin_cache, int64_t rot_dim,              \
                        bool is_neox, DType dtype, DType cache_dtype);           \
  /* Paged KV cache write: row t of key/value ([row_width] contiguous,           \
     rows key_stride/value_stride elements apart) goes to row slot_mapping[t]    \
     of key_cache/value_cache ([num_slots, row_width] contiguous, row_width =    \
     num_kv_heads * head_size). Tokens with a negative slot are skipped; slots   \
     must be < num_slots (the caller checks). K/V are in dtype, the caches in    \
     cache_dtype: the same, or bf16 under fp32 (rounded to nearest even). */     \
  void reshape_and_cache(const void* key, int64_t key_stride,                    \
                         const void* value, int64_t value_stride,                \
                         void* key_cache, void* value_cache,                     \
                         const int64_t* slot_mapping, int64_t num_tokens,        \
                         int64_t row_width, DType dtype, DType cache_dtype);     \
  /* Causal attention of new tokens over a paged KV cache; see                   \
     PagedAttentionParams. */                                                    \
  void paged_attention(const PagedAttentionParams& p);                            \
  /* out[m] = weight @ input[m] (+ bias) for m < M: input rows of K elements     \
     (input_stride apart), weight [N, K] contiguous, bias [N] or null, out rows  \
     of N elements (out_stride apart); all in dtype, summed in fp32, rounded     \
     once. */                                                                    \
  void linear(void* out, int64_t out_stride, const void* input,                  \
              int64_t input_stride, const void* weight, const void* bias,        \
              int64_t M, int64_t N, int64_t K, DType dtype);              \
  /* out[m] = W @ input[m] (+ bias) for fp32 input rows of K elements, W     \
     [N, K] in GGUF block layout `type` (N rows of K / B blocks, K a         \
     multiple of B: 32, or 256 for the K-quants), bias [N] fp32 or null;     \
     W's blocks are dequantized in registers and multiplied in fp32, or with \
     quantize_input W is in the                                              \
     panel layout of gguf_to_panels and the input is first quantized to     \
     int8 per 32-element block (see cc/cpu/gguf.cc). */                      \
  void gguf_linear(float* out, int64_t out_stride, const float* input,      \
                   int64_t input_stride, const void* weight, GgufType type,  \
                   const float* bias, int64_t M, int64_t N, int64_t K,       \
                   bool quantize_input);                                     \
  /* out[i] = row ids[i] of W (as above; N rows, in the panel layout if      \
     panels) dequantized to fp32; ids must be valid rows (the caller         \
     checks). */                                                             \
  void gguf_embedding(float* out, int64_t out_stride, const int64_t* ids,   \
                      int64_t num_ids, const void* weight, GgufType type,    \
                      int64_t N, int64_t K, bool panels);                    \
  /* W [N, K] rewritten in place into                                       \
     the panel layout that gguf_linear's int8 path reads (same bytes; see    \
     cc/cpu/gguf.cc). */                                                     \
  void gguf_to_panels(void* weight, GgufType type, int64_t N, int64_t K);    \
  /* out[r] = argmax_i logits[r][i] + gumbel(seeds[r], offsets[r], i) for    \
     rows of vocab fp32 logits (logits_stride apart): the exponential race   \
     with pagoda::sample's noise stream (see cc/cpu/sampling.cc); NaN wins,  \
     ties go to the lower index, as in torch.argmax. seeds and offsets null: \
     no noise, the greedy argmax. */                                         \
  void gumbel_argmax(int64_t* out, const float* logits,                      \
                     int64_t logits_stride, const int64_t* seeds,            \
                     const int64_t* offsets, int64_t num_rows,               \
                     int64_t vocab);

namespace pagoda {
namespace cpu {

// GGUF's quantized block formats, numbered as GGML's type ids, and
// kQ8_0Grouped, Pagoda's own (never in a file): Q8_0 blocks whose fp16 scale
// is the same for each group of q8_0_group_blocks(K / 32) consecutive blocks
// of a row, so that the int8 path sums a group's products in one integer
// accumulator (--quantization int8 requantizes weights to it at load).
enum class GgufType : int32_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kQ8_0Grouped = 1008 };

// Blocks of 32 in a kQ8_0Grouped group, for rows of nb blocks: the most, up
// to 8 (256 values, llama.cpp's Q8_K input blocks), that divide the row.
inline int64_t q8_0_group_blocks(int64_t nb) {
  for (int64_t g = 8; g > 1; --g) {
    if (nb % g == 0) return g;
  }
  return 1;
}

namespace avx2 {
PAGODA_CPU_KERNEL_DECLS
}  // namespace avx2
namespace avx512 {
PAGODA_CPU_KERNEL_DECLS
// linear with bf16 products on VDPBF16PS (other dtypes as linear); only for
// CPUs with AVX512_BF16 (cc/cpu_dispatch.cc's "avx512_bf16" table).
void linear_avx512_bf16(void* out, int64_t out_stride, const void* input,
                        int64_t input_stride, const void* weight,
                        const void* bias, int64_t M, int64_t N, int64_t K,
                        DType dtype);
}  // namespace avx512
}  // namespace cpu
}  // namespace pagoda
