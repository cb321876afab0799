// GGUF-packed weights (see cc/cpu/kernels.h): gguf_linear multiplies fp32
// activations by a weight kept in GGUF's blocks, gguf_embedding dequantizes
// looked-up rows.
//
// gguf_linear has two ways to multiply a block:
// - fp32 (the default; the weight as in the file, row after row): the weight
//   block is dequantized in registers to exactly the fp32 values
//   gguf_dequantize_reference gives (d * q, d * q + m: an fp16 scale times a
//   small integer is exact in fp32, and the minimum is added with one
//   rounding), then multiplied with fp32 FMAs. Only the order of the fp32 sums
//   differs from multiplying the dequantized matrix, while the weight is read
//   at its packed size: what decode (few rows, bound by the weight's bytes)
//   wants.
// - int8 (quantize_input; the weight in the panel layout below, repacked once
//   by gguf_to_panels): each input row is quantized per 32-element block to
//   int8 with one fp32 scale (d = max|x| / 127, q = round(x / d)), then every
//   block product is an integer dot product of 32 int8 pairs, scaled by
//   d_weight * d_input and summed in fp32 (llama.cpp's way). Q4_1's per-block
//   minimum multiplies the quantized block's sum, so the result is exactly
//   (quantized x) @ (dequantized W): multiplying it by x's exact sum instead
//   would leave the rounding error of d * q_w (all of one sign, up to 15 d)
//   rather than of the weight (which straddles 0), about twice the error on
//   SmolLM2. The products run in gguf_panel.inc: on AVX512_VNNI (checked at
//   run time) one vpdpbusd per 4 quants of 16 weight rows, else AVX2's
//   maddubs on 8 rows. kQ8_0Grouped (Q8_0 whose scale is shared by a group
//   of blocks, see kernels.h) has its input quantized per group too, and a
//   group's 8 x group dot products summed in one integer accumulator: the
//   float work per block of 32 (a conversion, a multiply, an FMA) falls to a
//   group's: at groups of 6 blocks the products run 5-15% faster than
//   Q8_0's (docs/BENCHMARKS.md).
//
// The K-quants (Q4_K, Q6_K) pack 256 values per super-block, with a scale
// (Q4_K: and a minimum) per sub-block of 32 (Q6_K: of 16) values. On the
// fp32 path a super-block's scales are decoded once per weight row, then its
// eight sub-blocks of 32 go through the same tiles as the 32-value formats,
// again to exactly gguf_dequantize_reference's fp32 values. On the int8 path
// each sub-block of 32 meets one int8 input block: Q4_K as Q4_1 with d * sc
// and -dmin * m for d and m, Q6_K with one integer sum per half of 16 values
// (its scales' span), the -32 offset folded into it with the input half's
// sum (QBlock::low).
//
// Threads split the output rows (weight rows) into contiguous ranges, the same
// for every chunk of input rows, so a thread's weight rows stay in its caches
// while it walks the inputs kInputChunk rows at a time.
#include <omp.h>

#include <cstdlib>

#include "cc/cpu/kernels.h"
#include "cc/cpu/vec.h"

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace {

using vec::Vec;

constexpr int64_t kBlock = 32;
constexpr int64_t kInputChunk = 64;  // input rows that stay in L2 across a thread's weight rows
constexpr int64_t kPanelInputBytes = 256 << 10;  // the int8 path's: quantized input rows, in bytes
constexpr int64_t kPrepareMinRows = 8;  // the int8 path prepares a tile's weights once per chunk from this many rows
constexpr int64_t kParallelMinMacs = 1 << 16;
constexpr int64_t kL1Bytes = 32 << 10;  // a core's L1 data cache (Zen 4, Intel since Ice Lake: 32-48 KB)

template <int N>
struct Int {
  static constexpr int value = N;
};

// Block layouts (little-endian, as in the file): an fp16 scale d (Q4_1: then
// an fp16 minimum m) and 32 quants. Q8_0: int8 q, x = d * q. Q4_0 and Q4_1:
// 16 bytes, element j in the low nibble of byte j and element j + 16 in its
// high nibble; Q4_0 x = d * (q - 8), Q4_1 x = d * q + m. The K-quants'
// super-blocks of 256 values: see QuantBlock below.
template <GgufType F>
struct BlockTraits;
template <>
struct BlockTraits<GgufType::kQ4_0> {
  static constexpr int64_t kValues = kBlock, kBytes = 18;
  static constexpr bool kSigned = true;
};
template <>
struct BlockTraits<GgufType::kQ4_1> {
  static constexpr int64_t kValues = kBlock, kBytes = 20;
  static constexpr bool kSigned = false;
};
template <>
struct BlockTraits<GgufType::kQ8_0> {
  static constexpr int64_t kValues = kBlock, kBytes = 34;
  static constexpr bool kSigned = true;
};
template <>
struct BlockTraits<GgufType::kQ4_K> {
  static constexpr int64_t kValues = 256, kBytes = 144;
};
template <>
struct BlockTraits<GgufType::kQ6_K> {
  static constexpr int64_t kValues = 256, kBytes = 210;
};

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// The 32 quants of a block as int8 in element order (Q4_0 already minus 8;
// Q4_1's are 0..15).
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

template <GgufType F>
inline __m256i quants(const uint8_t* block) {
  if constexpr (F == GgufType::kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else if constexpr (F == GgufType::kQ4_0) {
    return _mm256_sub_epi8(nibbles(block + 2), _mm256_set1_epi8(8));
  } else {
    return nibbles(block + 4);
  }
}

// ---------------------------------------------------------------------------
// The fp32 path: a block dequantized into kVecs vectors of kLanes fp32.

// Prefetches the weight rows of the next tile (bytes from `next`), spread
// over this tile's nb blocks, so that they arrive while this tile computes:
// at one input row the tiles are bound by the weight's bytes.
struct NextTile {
  const char* next;
  int64_t lines_per_block;
  NextTile(const uint8_t* next_rows, int64_t bytes, int64_t nb)
      : next(reinterpret_cast<const char*>(next_rows)), lines_per_block((bytes / 64 + nb - 1) / nb) {}
  void fetch(int64_t b) const {
    for (int64_t j = 0; j < lines_per_block; ++j) vec::prefetch(next + (b * lines_per_block + j) * 64);
  }
};

constexpr int kVecs = static_cast<int>(kBlock) / vec::kLanes;  // 2 (AVX-512) or 4 (AVX2)

// int8 lanes -> fp32 vectors, element order kept.
inline void widen(__m256i q, Vec out[kVecs]) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
#ifdef __AVX512F__
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
#else
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
#endif
}

// The fp16 at p in every lane, converted from a broadcast rather than
// converted as a scalar and then broadcast.
inline Vec scale_at(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, sizeof(h));
#ifdef __AVX512F__
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h)));
#else
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
#endif
}

// The block's 32 weights, the very fp32 values of gguf_dequantize_reference.
template <GgufType F>
inline void dequantize_block(const uint8_t* block, Vec out[kVecs]) {
#ifdef __AVX512F__
  if constexpr (F != GgufType::kQ8_0) {
    // A 4-bit quant takes one of 16 values: compute them once (one vector)
    // and look each element up with vpermps, which reads the low 4 bits of
    // each index lane -- cheaper than widening and converting 32 quants.
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (F == GgufType::kQ4_1 ? 4 : 2)));
    const __m512i low = _mm512_cvtepu8_epi32(packed);  // lane j: byte j, its low nibble = element j
    const __m512i high = _mm512_srli_epi32(low, 4);    // lane j: element j + 16
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 values;
    if constexpr (F == GgufType::kQ4_1) {
      // d and m converted together: lanes d, m, d, m, ...
      uint32_t dm;
      __builtin_memcpy(&dm, block, sizeof(dm));
      const __m512 pairs = _mm512_cvtph_ps(_mm256_set1_epi32(static_cast<int>(dm)));
      values = _mm512_fmadd_ps(iota, _mm512_moveldup_ps(pairs), _mm512_movehdup_ps(pairs));
    } else {
      values = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), scale_at(block).v);
    }
    out[0] = _mm512_permutexvar_ps(low, values);
    out[1] = _mm512_permutexvar_ps(high, values);
    return;
  }
#endif
  widen(quants<F>(block), out);
  const Vec d = scale_at(block);
  if constexpr (F == GgufType::kQ4_1) {
    const Vec m = vec::set1(fp16_at(block + 2));
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) out[v] = vec::fmadd(out[v], d, m);
  } else {
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) out[v] = out[v] * d;
  }
}

// kLanes bytes at p as fp32 lanes (int8 or uint8).
template <bool Signed>
inline Vec byte_lanes(const uint8_t* p) {
#ifdef __AVX512F__
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#endif
}

// The 32 bytes at p shifted right by `shift` bits each, masked to `mask`.
inline __m256i bits(const uint8_t* p, int shift, int mask) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}

// One block of a row, read sub-block by sub-block of kBlock values:
// dequantize(s, out) gives sub-block s's 32 fp32 weights. The 32-value
// formats are their own single sub-block.
template <GgufType F>
struct QuantBlock {
  static constexpr int kSubBlocks = 1;
  const uint8_t* block;
  void load(const uint8_t* p) { block = p; }
  void dequantize(int, Vec out[kVecs]) const { dequantize_block<F>(block, out); }
};

// Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and
// minimums m for 8 sub-blocks, 128 bytes of 4-bit quants (sub-blocks 2c and
// 2c + 1 in the low and high nibbles of bytes 32c..32c+31). x = (d * sc) * q -
// dmin * m: d * sc and d * sc * q are exact in fp32 (11 + 6 + 4 bits), so one
// fused multiply-subtract rounds as the reference's subtraction does.
template <>
struct QuantBlock<GgufType::kQ4_K> {
  static constexpr int kSubBlocks = 8;
  const uint8_t* qs;
  float scale[16];  // d * sc of sub-blocks 0..7, then dmin * m of 0..7

  void load(const uint8_t* p) {
    qs = p + 16;
    // llama.cpp's unpacking: bytes 0-3 hold sc 0-3 (low 6 bits), 4-7 m 0-3;
    // sc and m 4-7 are the nibbles of bytes 8-11 with the top 2 bits of
    // bytes 0-3 (sc) and 4-7 (m) above them.
    uint32_t u[4];
    __builtin_memcpy(u, p + 4, 12);
    const uint32_t m_low = u[1] & 0x3f3f3f3fu;
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = m_low;
    u[0] &= 0x3f3f3f3fu;
    const uint8_t* sc_m = reinterpret_cast<const uint8_t*>(u);
#ifdef __AVX512F__
    const __m512 d_dmin = _mm512_mask_blend_ps(0xff00, scale_at(p).v, scale_at(p + 2).v);
    vec::store<DType::kFloat32>(scale, byte_lanes<false>(sc_m) * d_dmin);
#else
    vec::store<DType::kFloat32>(scale, byte_lanes<false>(sc_m) * scale_at(p));
    vec::store<DType::kFloat32>(scale + 8, byte_lanes<false>(sc_m + 8) * scale_at(p + 2));
#endif
  }

  void dequantize(int s, Vec out[kVecs]) const {
    const uint8_t* q = qs + (s >> 1) * 32;
    const int shift = (s & 1) * 4;
#ifdef __AVX512F__
    // As Q4_1: the 16 possible values, looked up by vpermps (low 4 bits of
    // each index lane).
    const __m128i count = _mm_cvtsi32_si128(shift);
    const __m512i low = _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), count);
    const __m512i high =
        _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))), count);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values = _mm512_fmsub_ps(iota, _mm512_set1_ps(scale[s]), _mm512_set1_ps(scale[8 + s]));
    out[0] = _mm512_permutexvar_ps(low, values);
    out[1] = _mm512_permutexvar_ps(high, values);
#else
    widen(bits(q, shift, 0x0f), out);
    const Vec sc = vec::set1(scale[s]), m = vec::set1(scale[8 + s]);
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) out[v] = vec::fmsub(out[v], sc, m);
#endif
  }
};

// Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16
// int8 scales sc (one per 16 values), fp16 d. Sub-block s (32 values) of half
// h = s / 4, t = s % 4: low bits from the nibble t / 2 of ql bytes 64h +
// 32 (t % 2) .., high bits 2t..2t+1 of qh bytes 32h ..; x = (d * sc) *
// (q - 32), exact in fp32 (11 + 7 + 5 bits).
template <>
struct QuantBlock<GgufType::kQ6_K> {
  static constexpr int kSubBlocks = 8;
  const uint8_t* ql;
  float scale[16];  // d * sc

  void load(const uint8_t* p) {
    ql = p;
    const Vec d = scale_at(p + 208);
#pragma GCC unroll 2
    for (int i = 0; i < 16; i += vec::kLanes) vec::store<DType::kFloat32>(scale + i, byte_lanes<true>(p + 192 + i) * d);
  }

  void dequantize(int s, Vec out[kVecs]) const {
    const int h = s >> 2, t = s & 3;
    const __m256i low = bits(ql + 64 * h + 32 * (t & 1), 4 * (t >> 1), 0x0f);
    const __m256i high = bits(ql + 128 + 32 * h, 2 * t, 0x03);
    widen(_mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32)), out);
    // Sub-block s spans scales 2s and 2s + 1, 16 values each.
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) out[v] = out[v] * vec::set1(scale[2 * s + v * vec::kLanes / 16]);
  }
};

// An NB x MB tile of fp32 products: NB weight rows (row_bytes apart from w)
// by MB input rows (x_stride apart from x), the blocks of NB rows dequantized
// once for all MB inputs.
template <GgufType F>
struct F32Tile {
  // AVX2: 2 x 4 accumulators, 2 x 4 weight vectors and the input fill 17 of
  // 16 registers (the compiler interleaves); AVX-512: 16 + 8 + 1 of 32.
#ifdef __AVX512F__
  static constexpr int kRowTile = 4;
#else
  static constexpr int kRowTile = 2;
#endif
  static constexpr int kInputTile = 4;

  const uint8_t* weight;
  int64_t row_bytes, nb;
  const float* x;
  int64_t x_stride;

  template <int NB, int MB>
  void run(int64_t n0, int64_t m0, float out[MB][NB]) const {
    const uint8_t* w = weight + n0 * row_bytes;
    const float* xm = x + m0 * x_stride;
    Vec acc[MB][NB];
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) acc[m][n] = vec::zero();
    }
    const NextTile next(w + NB * row_bytes, NB * row_bytes, nb);
    for (int64_t b = 0; b < nb; ++b) {
      next.fetch(b);
      QuantBlock<F> blocks[NB];
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) blocks[n].load(w + n * row_bytes + b * BlockTraits<F>::kBytes);
#pragma GCC unroll 8
      for (int s = 0; s < QuantBlock<F>::kSubBlocks; ++s) {
        const float* xs = xm + b * BlockTraits<F>::kValues + s * kBlock;
        Vec wv[NB][kVecs];
#pragma GCC unroll 4
        for (int n = 0; n < NB; ++n) blocks[n].dequantize(s, wv[n]);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
#pragma GCC unroll 4
          for (int v = 0; v < kVecs; ++v) {
            const Vec xv = vec::load<DType::kFloat32>(xs + m * x_stride + v * vec::kLanes);
#pragma GCC unroll 4
            for (int n = 0; n < NB; ++n) acc[m][n] = vec::fmadd(xv, wv[n][v], acc[m][n]);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) out[m][n] = vec::hsum(acc[m][n]);
    }
  }
};

// ---------------------------------------------------------------------------
// The int8 path.

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum8(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  return _mm_cvtsi128_si32(s4);
}

// An input block quantized to int8: x ~ d * q; sum = sum(q), s = d * sum,
// low = the sum of q's first 16 (Q6_K's scale halves).
struct QBlock {
  float d, s;
  int32_t sum, low;
  int8_t q[kBlock];
};

// n consecutive blocks of an input row quantized with one scale, that of
// their largest magnitude (1 block for the file's formats, a group for
// kQ8_0Grouped): d = max|x| / 127, q = round(x / d); each block keeps d and
// its own sums.
inline void quantize_blocks(const float* x, int64_t n, QBlock* out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n * kBlock / 8; ++i) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(x + 8 * i), abs_mask));
  const float max_abs = hmax8(amax);
  const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
  for (int64_t b = 0; b < n; ++b) {
    QBlock& block = out[b];
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 v = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // packs work within 128-bit halves: the bytes come out as dwords
    // (q0[0:4] q1[0:4] q2[0:4] q3[0:4] | q0[4:8] q1[4:8] q2[4:8] q3[4:8]).
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(block.q), ordered);
    block.d = max_abs / 127.0f;
    block.low = hsum8(_mm256_add_epi32(q[0], q[1]));
    block.sum = block.low + hsum8(_mm256_add_epi32(q[2], q[3]));
    block.s = block.d * static_cast<float>(block.sum);
  }
}

// The panel layout of the int8 path, byte for byte the size of the file's:
// each whole group of kPanelRows weight rows becomes one panel, in the same
// bytes, holding the 16 rows' blocks transposed so that a 512-bit load gives
// a vector with one row per 32-bit lane:
//   nb x kVectors vectors of 64 bytes: block b's vector j, lane n = row n's
//     bytes 4j..4j+3 of the block without its fp16 fields, in file order
//     (Q4_0/Q4_1: 4 vectors of quants packed as in the file, byte i holding
//     element i in its low nibble and i + 16 in its high one; Q8_0: 8, q +
//     128, unsigned; Q4_K: 3 of 6-bit scales and minimums, then 32 of quants;
//     Q6_K: 32 of low 4 bits, 16 of high 2 bits, 4 of int8 scales);
//   then per fp16 field (d; Q4_1 m; Q4_K dmin) nb x 16 fp16 (block b's at
//     32 b).
// The rows past the last whole group stay as in the file (the kernel builds
// their panel per call).
constexpr int64_t kPanelRows = 16;

template <GgufType F>
struct PanelLayout {
  static constexpr int64_t kBlockBytes = BlockTraits<F>::kBytes;
  static constexpr int kFp16At = F == GgufType::kQ6_K ? 208 : 0;  // the fp16 fields' bytes in a block
  static constexpr int kFp16Bytes = F == GgufType::kQ4_1 || F == GgufType::kQ4_K ? 4 : 2;
  static constexpr int kVectors = (kBlockBytes - kFp16Bytes) / 4;
};

// Byte offset within a panel of row n's byte i (< kBlockBytes, in the file's
// block order) of block b.
template <GgufType F>
inline int64_t panel_offset(int64_t nb, int64_t n, int64_t b, int i) {
  using L = PanelLayout<F>;
  if (i < L::kFp16At || i >= L::kFp16At + L::kFp16Bytes) {
    const int q = i < L::kFp16At ? i : i - L::kFp16Bytes;
    return (b * L::kVectors + q / 4) * 64 + n * 4 + q % 4;
  }
  const int f = i - L::kFp16At;
  return nb * L::kVectors * 64 + ((f / 2) * nb + b) * 2 * kPanelRows + n * 2 + f % 2;
}

template <GgufType F>
inline uint8_t to_panel_byte(int i, uint8_t byte) {
  return F == GgufType::kQ8_0 && i >= PanelLayout<F>::kFp16Bytes ? byte ^ 0x80 : byte;
}

// `rows` (<= kPanelRows) rows as in the file, row_bytes apart, into one
// panel; the lanes of missing rows are zero (scale 0).
template <GgufType F>
void panel_from_rows(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t nb, uint8_t* panel) {
  constexpr int64_t kBytes = BlockTraits<F>::kBytes;
  __builtin_memset(panel, 0, kPanelRows * row_bytes);
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = w + n * row_bytes + b * kBytes;
      for (int i = 0; i < kBytes; ++i) panel[panel_offset<F>(nb, n, b, i)] = to_panel_byte<F>(i, block[i]);
    }
  }
}

// Row n's block b back in the file's byte order.
template <GgufType F>
void block_from_panel(const uint8_t* panel, int64_t nb, int64_t n, int64_t b, uint8_t* block) {
  for (int i = 0; i < BlockTraits<F>::kBytes; ++i) block[i] = to_panel_byte<F>(i, panel[panel_offset<F>(nb, n, b, i)]);
}

namespace plain {
#include "cc/cpu/gguf_panel.inc"
}  // namespace plain

#ifdef __AVX512F__
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#define PAGODA_GGUF_VNNI
namespace vnni {
#include "cc/cpu/gguf_panel.inc"
}  // namespace vnni
#undef PAGODA_GGUF_VNNI
#pragma GCC pop_options

bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}
#endif

// ---------------------------------------------------------------------------
// Both paths: out rows [n_begin, n_end) of input rows [m_begin, m_end), in
// tiles of Tile::kRowTile weight rows by up to Tile::kInputTile input rows.
template <class Tile>
void multiply_rows(const Tile& tile, float* out, int64_t out_stride, const float* bias, int64_t n_begin,
                   int64_t n_end, int64_t m_begin, int64_t m_end) {
  auto run = [&](auto nb_constant, auto mb_constant, int64_t n0, int64_t m0) {
    constexpr int NB = decltype(nb_constant)::value;
    constexpr int MB = decltype(mb_constant)::value;
    float sums[MB][NB];
    tile.template run<NB, MB>(n0, m0, sums);
    for (int m = 0; m < MB; ++m) {
      float* o = out + (m0 + m) * out_stride + n0;
      for (int n = 0; n < NB; ++n) o[n] = sums[m][n] + (bias ? bias[n0 + n] : 0.0f);
    }
  };
  static_assert(Tile::kInputTile == 4, "row_block handles remainders of 1 to 3 input rows");
  auto row_block = [&](auto nb_constant, int64_t n0) {
    int64_t m0 = m_begin;
    for (; m0 + Tile::kInputTile <= m_end; m0 += Tile::kInputTile) run(nb_constant, Int<Tile::kInputTile>{}, n0, m0);
    switch (m_end - m0) {
      case 3: run(nb_constant, Int<3>{}, n0, m0); break;
      case 2: run(nb_constant, Int<2>{}, n0, m0); break;
      case 1: run(nb_constant, Int<1>{}, n0, m0); break;
      default: break;
    }
  };
  int64_t n0 = n_begin;
  for (; n0 + Tile::kRowTile <= n_end; n0 += Tile::kRowTile) row_block(Int<Tile::kRowTile>{}, n0);
  for (; n0 < n_end; ++n0) row_block(Int<1>{}, n0);
}

// The N weight rows split into one contiguous range of whole tiles per
// thread; each thread walks the inputs kInputChunk rows at a time.
template <class Tile>
void multiply(const Tile& tile, float* out, int64_t out_stride, const float* bias, int64_t M, int64_t N, int64_t K) {
  const bool parallel = M * N * K >= kParallelMinMacs && N >= 2 * Tile::kRowTile;
#pragma omp parallel if (parallel)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t tiles = (N + Tile::kRowTile - 1) / Tile::kRowTile;
    const int64_t n_begin = tiles * t / threads * Tile::kRowTile;
    const int64_t n_end = t + 1 == threads ? N : tiles * (t + 1) / threads * Tile::kRowTile;
    for (int64_t m0 = 0; m0 < M; m0 += kInputChunk) {
      multiply_rows(tile, out, out_stride, bias, n_begin, n_end, m0, m0 + kInputChunk < M ? m0 + kInputChunk : M);
    }
  }
}

// The int8 path, W in the panel layout (nb blocks a row); group: the blocks
// of 32 that share a scale (Q8_0 only: see multiply_panels).
template <GgufType F>
void gguf_linear_int8(float* out, int64_t out_stride, const float* input, int64_t input_stride,
                      const uint8_t* weight, const float* bias, int64_t M, int64_t N, int64_t K, int64_t nb,
                      int64_t group) {
  const int64_t nbx = K / kBlock;
  QBlock* x = new QBlock[M * nbx];
  vec::parallel_for_rows(M, K, [&](int64_t m) {
    for (int64_t b = 0; b < nbx; b += group) {
      quantize_blocks(input + m * input_stride + b * kBlock, group, x + m * nbx + b);
    }
  });
#ifdef __AVX512F__
  static const bool vnni_here = has_vnni();
  if (vnni_here) {
    vnni::multiply_panels<F>(out, out_stride, x, weight, nb, group, bias, M, N);
    delete[] x;
    return;
  }
#endif
  plain::multiply_panels<F>(out, out_stride, x, weight, nb, group, bias, M, N);
  delete[] x;
}

template <GgufType F>
void gguf_linear_impl(float* out, int64_t out_stride, const float* input, int64_t input_stride,
                      const uint8_t* weight, const float* bias, int64_t M, int64_t N, int64_t K,
                      bool quantize_input, int64_t group = 1) {
  const int64_t nb = K / BlockTraits<F>::kValues;
  const int64_t row_bytes = nb * BlockTraits<F>::kBytes;
  if (!quantize_input) {
    return multiply(F32Tile<F>{weight, row_bytes, nb, input, input_stride}, out, out_stride, bias, M, N, K);
  }
  gguf_linear_int8<F>(out, out_stride, input, input_stride, weight, bias, M, N, K, nb, group);
}

template <GgufType F>
void gguf_embedding_impl(float* out, int64_t out_stride, const int64_t* ids, int64_t num_ids,
                         const uint8_t* weight, int64_t N, int64_t K, bool panels) {
  constexpr int64_t kBytes = BlockTraits<F>::kBytes;
  const int64_t nb = K / BlockTraits<F>::kValues;
  const int64_t row_bytes = nb * kBytes;
  vec::parallel_for_rows(num_ids, K, [&](int64_t i) {
    const uint8_t* row = weight + ids[i] * row_bytes;
    // A row inside a whole panel: its blocks gathered back into file order.
    const bool in_panel = panels && ids[i] < N / kPanelRows * kPanelRows;
    float* o = out + i * out_stride;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t gathered[kBytes];
      const uint8_t* bytes = row + b * kBytes;
      if (in_panel) {
        block_from_panel<F>(weight + ids[i] / kPanelRows * kPanelRows * row_bytes, nb, ids[i] % kPanelRows, b,
                            gathered);
        bytes = gathered;
      }
      QuantBlock<F> block;
      block.load(bytes);
      for (int s = 0; s < QuantBlock<F>::kSubBlocks; ++s) {
        Vec values[kVecs];
        block.dequantize(s, values);
        for (int v = 0; v < kVecs; ++v) {
          vec::store<DType::kFloat32>(o + b * BlockTraits<F>::kValues + s * kBlock + v * vec::kLanes, values[v]);
        }
      }
    }
  });
}

// W's whole groups of kPanelRows rows, each rewritten in place as a panel.
template <GgufType F>
void to_panels(uint8_t* w, int64_t N, int64_t K) {
  const int64_t nb = K / BlockTraits<F>::kValues, row_bytes = nb * BlockTraits<F>::kBytes;
  const int64_t panel_bytes = kPanelRows * row_bytes;
  vec::parallel_for_rows(N / kPanelRows, panel_bytes, [&](int64_t g) {
    uint8_t* rows = new uint8_t[panel_bytes];
    __builtin_memcpy(rows, w + g * panel_bytes, panel_bytes);
    panel_from_rows<F>(rows, row_bytes, kPanelRows, nb, w + g * panel_bytes);
    delete[] rows;
  });
}

}  // namespace

void gguf_linear(float* out, int64_t out_stride, const float* input, int64_t input_stride, const void* weight,
                 GgufType type, const float* bias, int64_t M, int64_t N, int64_t K, bool quantize_input) {
  if (M <= 0 || N <= 0) return;
  const uint8_t* w = static_cast<const uint8_t*>(weight);
  switch (type) {
    case GgufType::kQ4_0:
      return gguf_linear_impl<GgufType::kQ4_0>(out, out_stride, input, input_stride, w, bias, M, N, K,
                                               quantize_input);
    case GgufType::kQ4_1:
      return gguf_linear_impl<GgufType::kQ4_1>(out, out_stride, input, input_stride, w, bias, M, N, K,
                                               quantize_input);
    case GgufType::kQ8_0:
      return gguf_linear_impl<GgufType::kQ8_0>(out, out_stride, input, input_stride, w, bias, M, N, K,
                                               quantize_input);
    case GgufType::kQ8_0Grouped:
      return gguf_linear_impl<GgufType::kQ8_0>(out, out_stride, input, input_stride, w, bias, M, N, K,
                                               quantize_input, q8_0_group_blocks(K / kBlock));
    case GgufType::kQ4_K:
      return gguf_linear_impl<GgufType::kQ4_K>(out, out_stride, input, input_stride, w, bias, M, N, K,
                                               quantize_input);
    case GgufType::kQ6_K:
      return gguf_linear_impl<GgufType::kQ6_K>(out, out_stride, input, input_stride, w, bias, M, N, K,
                                               quantize_input);
  }
}

void gguf_embedding(float* out, int64_t out_stride, const int64_t* ids, int64_t num_ids, const void* weight,
                    GgufType type, int64_t N, int64_t K, bool panels) {
  if (num_ids <= 0) return;
  const uint8_t* w = static_cast<const uint8_t*>(weight);
  switch (type) {
    case GgufType::kQ4_0: return gguf_embedding_impl<GgufType::kQ4_0>(out, out_stride, ids, num_ids, w, N, K, panels);
    case GgufType::kQ4_1: return gguf_embedding_impl<GgufType::kQ4_1>(out, out_stride, ids, num_ids, w, N, K, panels);
    case GgufType::kQ8_0:
    case GgufType::kQ8_0Grouped:
      return gguf_embedding_impl<GgufType::kQ8_0>(out, out_stride, ids, num_ids, w, N, K, panels);
    case GgufType::kQ4_K: return gguf_embedding_impl<GgufType::kQ4_K>(out, out_stride, ids, num_ids, w, N, K, panels);
    case GgufType::kQ6_K: return gguf_embedding_impl<GgufType::kQ6_K>(out, out_stride, ids, num_ids, w, N, K, panels);
  }
}

void gguf_to_panels(void* weight, GgufType type, int64_t N, int64_t K) {
  uint8_t* w = static_cast<uint8_t*>(weight);
  switch (type) {
    case GgufType::kQ4_0: return to_panels<GgufType::kQ4_0>(w, N, K);
    case GgufType::kQ4_1: return to_panels<GgufType::kQ4_1>(w, N, K);
    case GgufType::kQ8_0:
    case GgufType::kQ8_0Grouped: return to_panels<GgufType::kQ8_0>(w, N, K);
    case GgufType::kQ4_K: return to_panels<GgufType::kQ4_K>(w, N, K);
    case GgufType::kQ6_K: return to_panels<GgufType::kQ6_K>(w, N, K);
  }
}

}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
