// A small fp32 SIMD abstraction for the CPU kernels.
//
// This header is included by sources that are compiled twice, once per
// instruction set (see cc/cpu/kernels.h):
//   -mavx2 -mfma -mf16c                          -DPAGODA_CPU_NS=avx2
//   -mavx512f -mavx512bw -mavx512vl -mfma -mf16c -DPAGODA_CPU_NS=avx512
// Everything here lives in pagoda::cpu::PAGODA_CPU_NS::vec, so the two builds
// never define the same symbol (no ODR clash at link time). For the same
// reason the kernels avoid out-of-line std:: helpers (inline functions of
// standard headers could be emitted as weak symbols compiled with AVX-512 and
// then picked by the linker for the AVX2 build too); only intrinsics (which
// are always inlined) and builtins are used.
//
// Vec holds kLanes fp32 values: 16 with AVX-512, 8 with AVX2. Loads convert
// from and stores convert to the storage type of a DType:
//   kFloat32  -> float
//   kBFloat16 -> uint16_t bits; fp32 -> bf16 rounds to nearest even, NaN stays
//                NaN (quieted, sign and top payload bits kept)
//   kFloat16  -> uint16_t bits; F16C conversions, round to nearest even
// load_partial/store_partial handle 0 <= n < kLanes elements and never touch
// memory past element n-1 (AVX-512: masked instructions; AVX2: a bounce
// buffer); lanes past n load as 0.
#pragma once

// GCC 12.1/12.2 report false -Wmaybe-uninitialized warnings from the
// _mm512_undefined_* helpers inside avx512fintrin.h once they are inlined
// (GCC PR105593, fixed in 12.3); the warnings point into the header, so
// silencing them for the header alone is enough.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>

#include "cc/dtype.h"

#ifndef PAGODA_CPU_NS
#error "PAGODA_CPU_NS must be defined (avx2 or avx512) when building cc/cpu"
#endif

#if defined(__AVX512F__)
#if !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__FMA__) || \
    !defined(__F16C__)
#error "the AVX-512 build needs -mavx512f -mavx512bw -mavx512vl -mfma -mf16c"
#endif
#else
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the AVX2 build needs -mavx2 -mfma -mf16c"
#endif
#endif

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace vec {

// ---------------------------------------------------------------------------
// Storage types.

template <DType D>
struct Storage {
  using type = uint16_t;  // bf16 / fp16 bit patterns
};
template <>
struct Storage<DType::kFloat32> {
  using type = float;
};
template <DType D>
using storage_t = typename Storage<D>::type;

// Scalar conversions (used for per-token tables and reference tails).
template <DType D>
inline float to_float(storage_t<D> x) {
  if constexpr (D == DType::kFloat32) {
    return x;
  } else if constexpr (D == DType::kBFloat16) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof(f));
    return f;
  } else {
    return _cvtsh_ss(x);
  }
}

template <DType D>
inline storage_t<D> from_float(float f) {
  if constexpr (D == DType::kFloat32) {
    return f;
  } else if constexpr (D == DType::kBFloat16) {
    uint32_t u;
    __builtin_memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: quiet it, keep sign
      return static_cast<uint16_t>((u | 0x00400000u) >> 16);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  } else {
    return static_cast<uint16_t>(
        _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// ---------------------------------------------------------------------------
// The vector type and arithmetic.

#ifdef __AVX512F__
constexpr int kLanes = 16;
using reg_t = __m512;
using ireg_t = __m512i;
using hreg_t = __m256i;  // kLanes 16-bit values
#else
constexpr int kLanes = 8;
using reg_t = __m256;
using ireg_t = __m256i;
using hreg_t = __m128i;  // kLanes 16-bit values
#endif

struct Vec {
  reg_t v;
  Vec() = default;
  Vec(reg_t r) : v(r) {}  // NOLINT: implicit on purpose
};

#ifdef __AVX512F__
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float f) { return _mm512_set1_ps(f); }
inline Vec operator+(Vec a, Vec b) { return _mm512_add_ps(a.v, b.v); }
inline Vec operator-(Vec a, Vec b) { return _mm512_sub_ps(a.v, b.v); }
inline Vec operator*(Vec a, Vec b) { return _mm512_mul_ps(a.v, b.v); }
inline Vec operator/(Vec a, Vec b) { return _mm512_div_ps(a.v, b.v); }
inline Vec neg(Vec a) {
  return _mm512_castsi512_ps(_mm512_xor_si512(
      _mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN)));
}
// a*b + c, a*b - c with one rounding.
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }
inline Vec fmsub(Vec a, Vec b, Vec c) { return _mm512_fmsub_ps(a.v, b.v, c.v); }
// Even lanes a*b - c, odd lanes a*b + c.
inline Vec fmaddsub(Vec a, Vec b, Vec c) {
  return _mm512_fmaddsub_ps(a.v, b.v, c.v);
}
// (x0, x1, x2, x3, ...) -> (x1, x0, x3, x2, ...)
inline Vec swap_pairs(Vec a) { return _mm512_permute_ps(a.v, 0xB1); }
// max/min return the second operand when either is NaN: vmax(c, x) and
// vmin(c, x) propagate a NaN in x.
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a.v, b.v); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a.v, b.v); }
inline Vec round_nearest(Vec a) {
  return _mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline float hsum(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float hmax(Vec a) { return _mm512_reduce_max_ps(a.v); }
#else
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec set1(float f) { return _mm256_set1_ps(f); }
inline Vec operator+(Vec a, Vec b) { return _mm256_add_ps(a.v, b.v); }
inline Vec operator-(Vec a, Vec b) { return _mm256_sub_ps(a.v, b.v); }
inline Vec operator*(Vec a, Vec b) { return _mm256_mul_ps(a.v, b.v); }
inline Vec operator/(Vec a, Vec b) { return _mm256_div_ps(a.v, b.v); }
inline Vec neg(Vec a) { return _mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f)); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
inline Vec fmsub(Vec a, Vec b, Vec c) { return _mm256_fmsub_ps(a.v, b.v, c.v); }
inline Vec fmaddsub(Vec a, Vec b, Vec c) {
  return _mm256_fmaddsub_ps(a.v, b.v, c.v);
}
inline Vec swap_pairs(Vec a) { return _mm256_permute_ps(a.v, 0xB1); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a.v, b.v); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a.v, b.v); }
inline Vec round_nearest(Vec a) {
  return _mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline float hsum(Vec a) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(a.v),
                         _mm256_extractf128_ps(a.v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}
inline float hmax(Vec a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a.v),
                        _mm256_extractf128_ps(a.v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
#endif

// The 8 partial sums of a vector's lanes (itself for AVX2), for hsum4.
#ifdef __AVX512F__
inline __m256 fold_halves(Vec a) {
  const __m256 hi =
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(a.v), hi);
}
#else
inline __m256 fold_halves(Vec a) { return a.v; }
#endif
// out[0..3] = hsum(a), hsum(b), hsum(c), hsum(d): cheaper than four hsum calls.
inline void hsum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  // hadd pairs neighbouring lanes within each 128-bit half:
  // ab = (a01 a23 b01 b23 | a45 a67 b45 b67), likewise cd; then
  // abcd = (a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567).
  const __m256 ab = _mm256_hadd_ps(fold_halves(a), fold_halves(b));
  const __m256 cd = _mm256_hadd_ps(fold_halves(c), fold_halves(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd),
                                _mm256_extractf128_ps(abcd, 1)));
}

// ---------------------------------------------------------------------------
// bf16 / fp16 <-> fp32 lane conversions.

#ifdef __AVX512F__
inline Vec bf16_to_f32(hreg_t h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// fp32 -> bf16 bits (round to nearest even) in the low 16 bits of each lane.
inline ireg_t f32_to_bf16_lanes(Vec a) {
  const ireg_t u = _mm512_castps_si512(a.v);
  const ireg_t lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                      _mm512_set1_epi32(1));
  const ireg_t r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb),
      16);
  const ireg_t qnan = _mm512_srli_epi32(
      _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)), 16);
  const __mmask16 isnan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(isnan, r, qnan);
}
inline hreg_t f32_to_bf16(Vec a) {
  return _mm512_cvtepi32_epi16(f32_to_bf16_lanes(a));
}
inline Vec round_bf16(Vec a) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(f32_to_bf16_lanes(a), 16));
}
inline Vec f16_to_f32(hreg_t h) { return _mm512_cvtph_ps(h); }
inline hreg_t f32_to_f16(Vec a) {
  return _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline __mmask16 first_n(int n) {
  return static_cast<__mmask16>((1u << n) - 1u);
}
#else
inline Vec bf16_to_f32(hreg_t h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline ireg_t f32_to_bf16_lanes(Vec a) {
  const ireg_t u = _mm256_castps_si256(a.v);
  const ireg_t lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                      _mm256_set1_epi32(1));
  const ireg_t r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
      16);
  const ireg_t qnan = _mm256_srli_epi32(
      _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), 16);
  const __m256 isnan = _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(isnan));
}
inline hreg_t f32_to_bf16(Vec a) {
  const ireg_t r = f32_to_bf16_lanes(a);  // every lane <= 0xffff: no saturation
  return _mm_packus_epi32(_mm256_castsi256_si128(r),
                          _mm256_extracti128_si256(r, 1));
}
inline Vec round_bf16(Vec a) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(f32_to_bf16_lanes(a), 16));
}
inline Vec f16_to_f32(hreg_t h) { return _mm256_cvtph_ps(h); }
inline hreg_t f32_to_f16(Vec a) {
  return _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif

// ---------------------------------------------------------------------------
// Loads and stores.

// kLanes elements at p.
template <DType D>
inline Vec load(const storage_t<D>* p) {
#ifdef __AVX512F__
  if constexpr (D == DType::kFloat32) {
    return _mm512_loadu_ps(p);
  } else {
    const hreg_t h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (D == DType::kBFloat16) return bf16_to_f32(h);
    else return f16_to_f32(h);
  }
#else
  if constexpr (D == DType::kFloat32) {
    return _mm256_loadu_ps(p);
  } else {
    const hreg_t h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (D == DType::kBFloat16) return bf16_to_f32(h);
    else return f16_to_f32(h);
  }
#endif
}

template <DType D>
inline void store(storage_t<D>* p, Vec a) {
#ifdef __AVX512F__
  if constexpr (D == DType::kFloat32) {
    _mm512_storeu_ps(p, a.v);
  } else if constexpr (D == DType::kBFloat16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32_to_bf16(a));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32_to_f16(a));
  }
#else
  if constexpr (D == DType::kFloat32) {
    _mm256_storeu_ps(p, a.v);
  } else if constexpr (D == DType::kBFloat16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f32_to_bf16(a));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f32_to_f16(a));
  }
#endif
}

// n (0 <= n < kLanes) elements at p; lanes >= n are 0. Reads nothing past
// p[n-1].
template <DType D>
inline Vec load_partial(const storage_t<D>* p, int n) {
#ifdef __AVX512F__
  const __mmask16 m = first_n(n);
  if constexpr (D == DType::kFloat32) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const hreg_t h = _mm256_maskz_loadu_epi16(m, p);
    if constexpr (D == DType::kBFloat16) return bf16_to_f32(h);
    else return f16_to_f32(h);
  }
#else
  alignas(32) storage_t<D> buf[kLanes] = {};
  __builtin_memcpy(buf, p, static_cast<unsigned>(n) * sizeof(storage_t<D>));
  return load<D>(buf);
#endif
}

// Writes lanes [0, n) of a to p[0..n-1]; nothing else is written.
template <DType D>
inline void store_partial(storage_t<D>* p, Vec a, int n) {
#ifdef __AVX512F__
  const __mmask16 m = first_n(n);
  if constexpr (D == DType::kFloat32) {
    _mm512_mask_storeu_ps(p, m, a.v);
  } else if constexpr (D == DType::kBFloat16) {
    _mm256_mask_storeu_epi16(p, m, f32_to_bf16(a));
  } else {
    _mm256_mask_storeu_epi16(p, m, f32_to_f16(a));
  }
#else
  alignas(32) storage_t<D> buf[kLanes];
  store<D>(buf, a);
  __builtin_memcpy(p, buf, static_cast<unsigned>(n) * sizeof(storage_t<D>));
#endif
}

// Rounds each lane to the nearest value of type D (the value a store<D> then
// load<D> round trip gives). Identity for fp32.
template <DType D>
inline Vec round_to(Vec a) {
  if constexpr (D == DType::kFloat32) {
    return a;
  } else if constexpr (D == DType::kBFloat16) {
    return round_bf16(a);
  } else {
    return f16_to_f32(f32_to_f16(a));
  }
}

// Asks for the cache line holding p to be fetched (never faults).
inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}
// The same into L2 only: for data fetched far ahead, which in L1 would evict
// the lines in use before it is needed.
inline void prefetch_l2(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}

// ---------------------------------------------------------------------------
// Transcendentals.

// exp(x) in fp32, relative error about 2 ulp over the whole range (Cephes
// polynomial on [-ln2/2, ln2/2], Cody-Waite reduction). Overflows to +inf for
// x >= 88.7228394, gives denormals down to 0 for x below about -103.97, and
// propagates NaN.
inline Vec exp(Vec x) {
  x = vmin(set1(88.7228394f), vmax(set1(-104.0f), x));
  const Vec m = round_nearest(x * set1(1.44269504088896341f));
  Vec r = fmadd(m, set1(-0.693359375f), x);
  r = fmadd(m, set1(2.12194440e-4f), r);
  Vec y = set1(1.9875691500e-4f);
  y = fmadd(y, r, set1(1.3981999507e-3f));
  y = fmadd(y, r, set1(8.3334519073e-3f));
  y = fmadd(y, r, set1(4.1665795894e-2f));
  y = fmadd(y, r, set1(1.6666665459e-1f));
  y = fmadd(y, r, set1(5.0000001201e-1f));
  y = fmadd(y, r * r, r) + set1(1.0f);
  // y * 2^m, m in [-150, 128]: split into two factors that are normal floats.
#ifdef __AVX512F__
  const ireg_t mi = _mm512_cvtps_epi32(m.v);
  const ireg_t m1 = _mm512_srai_epi32(mi, 1);
  const ireg_t m2 = _mm512_sub_epi32(mi, m1);
  const ireg_t bias = _mm512_set1_epi32(127);
  const Vec s1 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(m1, bias), 23));
  const Vec s2 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(m2, bias), 23));
#else
  const ireg_t mi = _mm256_cvtps_epi32(m.v);
  const ireg_t m1 = _mm256_srai_epi32(mi, 1);
  const ireg_t m2 = _mm256_sub_epi32(mi, m1);
  const ireg_t bias = _mm256_set1_epi32(127);
  const Vec s1 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(m1, bias), 23));
  const Vec s2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(m2, bias), 23));
#endif
  return (y * s1) * s2;
}

// silu(x) = x / (1 + exp(-x)), the formula PyTorch uses.
inline Vec silu(Vec x) { return x / (set1(1.0f) + exp(neg(x))); }

// ---------------------------------------------------------------------------
// Threading.

// Rows are processed in parallel only when there are several and the total
// work (in elements) is large enough to pay for an OpenMP fork/join; a single
// row never enters an OpenMP region.
constexpr int64_t kParallelMinElements = 16384;

template <typename F>
inline void parallel_for_rows(int64_t num_rows, int64_t elements_per_row,
                              const F& f) {
  if (num_rows <= 0) return;
  if (num_rows == 1 || num_rows * elements_per_row < kParallelMinElements) {
    for (int64_t t = 0; t < num_rows; ++t) f(t);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
  for (int64_t t = 0; t < num_rows; ++t) f(t);
}

}  // namespace vec
}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
