// linear (see cc/cpu/kernels.h): out[m, n] = sum_k input[m, k] * weight[n, k]
// (+ bias[n]), for the few-row products of decode (M = a handful of tokens).
//
// The weight is streamed from memory once: the N rows are split among the
// threads (static contiguous chunks) in blocks of kRowBlock rows, and each
// block is multiplied by every input row while it is still in L1; the next
// block is prefetched meanwhile, spread over the block's tiles, so that memory
// traffic overlaps the arithmetic. A tile of kRowBlock weight rows x up to
// kMaxTile input rows accumulates in vector registers over K (one fp32
// accumulator per output), then each accumulator is summed horizontally
// (cc/cpu/linear_tiles.inc).
//
// Two ways to multiply a tile:
// - fp32 FMAs (every build, every dtype): bf16/fp16 inputs are first
//   converted to an fp32 copy (small: M x K) so that the inner loop converts
//   only the weight.
// - VDPBF16PS (linear_avx512_bf16, bf16 only, for CPUs with AVX512_BF16): the
//   bf16 input and weight are multiplied as they are, 32 products per
//   instruction summed pairwise into 16 fp32 lanes; no conversion at all.
//   A bf16 product is exact in fp32, so only the order of the fp32 additions
//   differs from the FMA path, and the instruction treats denormal operands as
//   zero (bf16 denormals are below 1.2e-38).
#include "cc/cpu/kernels.h"
#include "cc/cpu/vec.h"

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace {

using namespace vec;  // NOLINT

template <int N>
struct Int {
  static constexpr int value = N;
};

// Below this many multiply-adds the product runs on one thread.
constexpr int64_t kParallelMinMacs = 1 << 16;

namespace fma {

// Weights of dtype D converted to fp32 in registers, inputs already fp32.
template <DType D>
struct Dot {
  static constexpr DType kDType = D;
  using W = storage_t<D>;
  using X = float;
  using Reg = Vec;
  static constexpr int kStep = kLanes;
  static Vec load_w(const W* p) { return load<D>(p); }
  static Vec load_w_partial(const W* p, int n) { return load_partial<D>(p, n); }
  static Vec load_x(const X* p) { return load<DType::kFloat32>(p); }
  static Vec load_x_partial(const X* p, int n) {
    return load_partial<DType::kFloat32>(p, n);
  }
  static Vec madd(Vec x, Vec w, Vec acc) { return fmadd(x, w, acc); }
};

#include "cc/cpu/linear_tiles.inc"

}  // namespace fma

#ifdef __AVX512F__
#pragma GCC push_options
#pragma GCC target("avx512bf16")
namespace bf16 {

// bf16 inputs and weights as they are: 16 pairs per fp32 lane and step.
struct Dot {
  static constexpr DType kDType = DType::kBFloat16;
  using W = uint16_t;
  using X = uint16_t;
  using Reg = __m512i;
  static constexpr int kStep = 32;
  static Reg load_w(const W* p) { return _mm512_loadu_si512(p); }
  static Reg load_w_partial(const W* p, int n) {
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << n) - 1u), p);
  }
  static Reg load_x(const X* p) { return load_w(p); }
  static Reg load_x_partial(const X* p, int n) { return load_w_partial(p, n); }
  static Vec madd(Reg x, Reg w, Vec acc) {
    return _mm512_dpbf16_ps(acc.v, (__m512bh)x, (__m512bh)w);
  }
};

#include "cc/cpu/linear_tiles.inc"

}  // namespace bf16
#pragma GCC pop_options
#endif

template <DType D>
void linear_fma(void* out, int64_t out_stride, const void* input,
                int64_t input_stride, const void* weight, const void* bias,
                int64_t M, int64_t N, int64_t K) {
  using T = storage_t<D>;
  T* o = static_cast<T*>(out);
  const T* w = static_cast<const T*>(weight);
  const T* b = static_cast<const T*>(bias);
  if constexpr (D == DType::kFloat32) {
    fma::multiply<fma::Dot<D>>(o, out_stride, static_cast<const float*>(input),
                               input_stride, w, b, M, N, K);
  } else {
    float* x = new float[M * K];
    const T* in = static_cast<const T*>(input);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) {
        x[m * K + k] = to_float<D>(in[m * input_stride + k]);
      }
    }
    fma::multiply<fma::Dot<D>>(o, out_stride, x, K, w, b, M, N, K);
    delete[] x;
  }
}

}  // namespace

void linear(void* out, int64_t out_stride, const void* input,
            int64_t input_stride, const void* weight, const void* bias,
            int64_t M, int64_t N, int64_t K, DType dtype) {
  if (M <= 0 || N <= 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return linear_fma<DType::kFloat32>(out, out_stride, input, input_stride,
                                         weight, bias, M, N, K);
    case DType::kBFloat16:
      return linear_fma<DType::kBFloat16>(out, out_stride, input, input_stride,
                                          weight, bias, M, N, K);
    case DType::kFloat16:
      return linear_fma<DType::kFloat16>(out, out_stride, input, input_stride,
                                         weight, bias, M, N, K);
  }
}

#ifdef __AVX512F__
void linear_avx512_bf16(void* out, int64_t out_stride, const void* input,
                        int64_t input_stride, const void* weight,
                        const void* bias, int64_t M, int64_t N, int64_t K,
                        DType dtype) {
  if (dtype != DType::kBFloat16) {
    return linear(out, out_stride, input, input_stride, weight, bias, M, N, K,
                  dtype);
  }
  if (M <= 0 || N <= 0) return;
  bf16::multiply<bf16::Dot>(
      static_cast<uint16_t*>(out), out_stride,
      static_cast<const uint16_t*>(input), input_stride,
      static_cast<const uint16_t*>(weight), static_cast<const uint16_t*>(bias),
      M, N, K);
}
#endif

}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
