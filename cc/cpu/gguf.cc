// GGUF-packed weights (see cc/cpu/kernels.h): gguf_linear multiplies fp32
// activations by a weight kept in GGUF's own block layout (no repacking: the
// bytes of the file, row after row), gguf_embedding dequantizes looked-up rows.
//
// gguf_linear quantizes each input row per 32-element block to int8 with one
// fp32 scale (d = max|x| / 127, q = round(x / d)), then every block product is
// an integer dot product of 32 int8 pairs, scaled by d_weight * d_input and
// summed in fp32. Q4_1's per-block minimum multiplies the quantized block's
// sum, so the result is exactly (quantized x) @ (dequantized W): multiplying
// it by x's exact sum instead would leave the rounding error of d * q_w (all
// of one sign, up to 15 d) rather than of the weight (which straddles 0),
// about twice the error on SmolLM2. Blocks are 256 bits, so both builds work on 256-bit
// vectors; the AVX-512 build differs in its 32 vector registers and, where
// the CPU has AVX512_VNNI (checked at run time), in one vpdpbusd per block.
//
// Threads split the output rows (weight rows) into contiguous ranges, the same
// for every chunk of input rows, so a thread's weight rows stay in its caches
// while it walks the inputs kInputChunk rows at a time.
#include <omp.h>

#include "cc/cpu/kernels.h"
#include "cc/cpu/vec.h"

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace {

constexpr int64_t kBlock = 32;
constexpr int kRowTile = 2;    // weight rows per tile (AVX2: 8 accumulators + operands fit 16 registers)
constexpr int kInputTile = 4;  // input rows per tile
constexpr int64_t kInputChunk = 64;  // input rows whose quantized blocks stay in L2 across a thread's weight rows
constexpr int64_t kParallelMinMacs = 1 << 16;

template <int N>
struct Int {
  static constexpr int value = N;
};

// Block layouts (little-endian, as in the file): an fp16 scale d (Q4_1: then
// an fp16 minimum m) and 32 quants. Q8_0: int8 q, x = d * q. Q4_0 and Q4_1:
// 16 bytes, element j in the low nibble of byte j and element j + 16 in its
// high nibble; Q4_0 x = d * (q - 8), Q4_1 x = d * q + m.
template <GgufType F>
struct BlockTraits;
template <>
struct BlockTraits<GgufType::kQ4_0> {
  static constexpr int64_t kBytes = 18;
  static constexpr bool kSigned = true;
};
template <>
struct BlockTraits<GgufType::kQ4_1> {
  static constexpr int64_t kBytes = 20;
  static constexpr bool kSigned = false;
};
template <>
struct BlockTraits<GgufType::kQ8_0> {
  static constexpr int64_t kBytes = 34;
  static constexpr bool kSigned = true;
};

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// One weight block in registers: u = the unsigned operand of the dot product
// (|q| for the signed formats), q = the signed quants (signed formats only).
struct Decoded {
  __m256i u, q;
  float d, min;
};

inline __m256i nibbles(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

template <GgufType F>
inline Decoded decode(const uint8_t* block) {
  Decoded r;
  r.d = fp16_at(block);
  if constexpr (F == GgufType::kQ8_0) {
    r.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    r.u = _mm256_sign_epi8(r.q, r.q);
    r.min = 0.0f;
  } else if constexpr (F == GgufType::kQ4_0) {
    r.q = _mm256_sub_epi8(nibbles(block + 2), _mm256_set1_epi8(8));
    r.u = _mm256_sign_epi8(r.q, r.q);
    r.min = 0.0f;
  } else {
    r.min = fp16_at(block + 2);
    r.u = nibbles(block + 4);
    r.q = r.u;
  }
  return r;
}

// Element j of a block, for the embedding lookup.
template <GgufType F>
inline void dequantize_block(const uint8_t* block, float* out) {
  const float d = fp16_at(block);
  for (int j = 0; j < kBlock; ++j) {
    if constexpr (F == GgufType::kQ8_0) {
      out[j] = d * static_cast<float>(static_cast<int8_t>(block[2 + j]));
    } else {
      const uint8_t* qs = block + (F == GgufType::kQ4_1 ? 4 : 2);
      const int q = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
      out[j] = F == GgufType::kQ4_1 ? d * static_cast<float>(q) + fp16_at(block + 2) : d * static_cast<float>(q - 8);
    }
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// An input block quantized to int8: x ~ d * q.
struct QBlock {
  float d;
  int8_t q[kBlock];
};

inline void quantize_block(const float* x, QBlock* out) {
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  }
  const float max_abs = hmax8(amax);
  out->d = max_abs / 127.0f;
  const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // packs work within 128-bit halves: the bytes come out as dwords
  // (q0[0:4] q1[0:4] q2[0:4] q3[0:4] | q0[4:8] q1[4:8] q2[4:8] q3[4:8]).
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out->q), ordered);
}

struct GgufLinearArgs {
  float* out;
  int64_t out_stride;
  const QBlock* x;  // M rows of K / 32 blocks
  const uint8_t* weight;
  const float* bias;
  int64_t M, N, K;
};

namespace plain {
#include "cc/cpu/gguf_dot.inc"
}  // namespace plain

#ifdef __AVX512F__
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#define PAGODA_GGUF_VNNI
namespace vnni {
#include "cc/cpu/gguf_dot.inc"
}  // namespace vnni
#undef PAGODA_GGUF_VNNI
#pragma GCC pop_options

bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}
#endif

using MultiplyRows = void (*)(const GgufLinearArgs&, int64_t, int64_t, int64_t, int64_t);

template <GgufType F>
MultiplyRows select_multiply_rows() {
#ifdef __AVX512F__
  static const bool vnni_here = has_vnni();
  if (vnni_here) return &vnni::multiply_rows<F>;
#endif
  return &plain::multiply_rows<F>;
}

template <GgufType F>
void gguf_linear_impl(float* out, int64_t out_stride, const float* input, int64_t input_stride,
                      const uint8_t* weight, const float* bias, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / kBlock;
  QBlock* x = new QBlock[M * nb];
  vec::parallel_for_rows(M, K, [&](int64_t m) {
    for (int64_t b = 0; b < nb; ++b) quantize_block(input + m * input_stride + b * kBlock, x + m * nb + b);
  });
  const GgufLinearArgs a{out, out_stride, x, weight, bias, M, N, K};
  const MultiplyRows multiply_rows = select_multiply_rows<F>();
  const bool parallel = M * N * K >= kParallelMinMacs && N >= 2 * kRowTile;
#pragma omp parallel if (parallel)
  {
    // Contiguous ranges of whole tiles, one per thread.
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t tiles = (N + kRowTile - 1) / kRowTile;
    const int64_t n_begin = tiles * t / threads * kRowTile;
    const int64_t n_end = t + 1 == threads ? N : tiles * (t + 1) / threads * kRowTile;
    for (int64_t m0 = 0; m0 < M; m0 += kInputChunk) {
      multiply_rows(a, n_begin, n_end, m0, m0 + kInputChunk < M ? m0 + kInputChunk : M);
    }
  }
  delete[] x;
}

template <GgufType F>
void gguf_embedding_impl(float* out, int64_t out_stride, const int64_t* ids, int64_t num_ids,
                         const uint8_t* weight, int64_t K) {
  const int64_t nb = K / kBlock;
  const int64_t row_bytes = nb * BlockTraits<F>::kBytes;
  vec::parallel_for_rows(num_ids, K, [&](int64_t i) {
    const uint8_t* row = weight + ids[i] * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      dequantize_block<F>(row + b * BlockTraits<F>::kBytes, out + i * out_stride + b * kBlock);
    }
  });
}

}  // namespace

void gguf_linear(float* out, int64_t out_stride, const float* input, int64_t input_stride, const void* weight,
                 GgufType type, const float* bias, int64_t M, int64_t N, int64_t K) {
  if (M <= 0 || N <= 0) return;
  const uint8_t* w = static_cast<const uint8_t*>(weight);
  switch (type) {
    case GgufType::kQ4_0:
      return gguf_linear_impl<GgufType::kQ4_0>(out, out_stride, input, input_stride, w, bias, M, N, K);
    case GgufType::kQ4_1:
      return gguf_linear_impl<GgufType::kQ4_1>(out, out_stride, input, input_stride, w, bias, M, N, K);
    case GgufType::kQ8_0:
      return gguf_linear_impl<GgufType::kQ8_0>(out, out_stride, input, input_stride, w, bias, M, N, K);
  }
}

void gguf_embedding(float* out, int64_t out_stride, const int64_t* ids, int64_t num_ids, const void* weight,
                    GgufType type, int64_t K) {
  if (num_ids <= 0) return;
  const uint8_t* w = static_cast<const uint8_t*>(weight);
  switch (type) {
    case GgufType::kQ4_0: return gguf_embedding_impl<GgufType::kQ4_0>(out, out_stride, ids, num_ids, w, K);
    case GgufType::kQ4_1: return gguf_embedding_impl<GgufType::kQ4_1>(out, out_stride, ids, num_ids, w, K);
    case GgufType::kQ8_0: return gguf_embedding_impl<GgufType::kQ8_0>(out, out_stride, ids, num_ids, w, K);
  }
}

}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
