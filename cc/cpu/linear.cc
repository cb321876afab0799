// linear (see cc/cpu/kernels.h): out[m, n] = sum_k input[m, k] * weight[n, k]
// (+ bias[n]), for the few-row products of decode (M = a handful of tokens).
//
// The weight is streamed from memory once: the N rows are split among the
// threads (static contiguous chunks) in blocks of kRowBlock rows, and each
// block is multiplied by every input row while it is still in L1; the next
// block is prefetched meanwhile, spread over the block's tiles, so that memory
// traffic overlaps the arithmetic. A tile of kRowBlock weight rows x up to
// kMaxTile input rows accumulates in vector registers over K (fp32 FMAs, one
// accumulator per output), then each accumulator is summed horizontally.
// bf16/fp16 inputs are first converted to an fp32 copy (small: M x K) so that
// the inner loop converts only the weight.
#include "cc/cpu/kernels.h"
#include "cc/cpu/vec.h"

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace {

using namespace vec;  // NOLINT

constexpr int L = kLanes;
// A tile: 3 weight rows x up to 4 input rows. With AVX2 its 12 accumulators,
// 3 weight vectors and the input vector fill the 16 vector registers.
constexpr int kRowBlock = 3;  // weight rows per tile
constexpr int kMaxTile = 4;   // input rows per tile
static_assert(kMaxTile == 4, "row_block handles remainders of 1 to 3 rows");

template <int N>
struct Int {
  static constexpr int value = N;
};

// acc[m][n] = sum_k x[m][k] * w[n][k] for an NB x MB tile. w rows are K
// elements apart, x rows x_stride apart (fp32). Meanwhile the cache lines
// [prefetch_begin, prefetch_end) are prefetched, spread over the k steps, so
// that the next weight rows arrive while this tile computes.
template <DType D, int NB, int MB>
inline void tile(const storage_t<D>* w, int64_t K, const float* x,
                 int64_t x_stride, const char* prefetch_begin,
                 const char* prefetch_end, float out[MB][NB]) {
  Vec acc[MB][NB];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) {
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) acc[m][n] = zero();
  }
  const int64_t steps = K / L;
  const int64_t lines = (prefetch_end - prefetch_begin + 63) / 64;
  const int64_t lines_per_step = steps > 0 ? (lines + steps - 1) / steps : 0;
  const char* next_line = prefetch_begin;
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    for (int64_t j = 0; j < lines_per_step && next_line < prefetch_end; ++j) {
      prefetch(next_line);
      next_line += 64;
    }
    Vec wv[NB];
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) wv[n] = load<D>(w + n * K + k);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const Vec xv = load<DType::kFloat32>(x + m * x_stride + k);
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) acc[m][n] = fmadd(xv, wv[n], acc[m][n]);
    }
  }
  if (k < K) {
    const int r = static_cast<int>(K - k);
    Vec wv[NB];
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) wv[n] = load_partial<D>(w + n * K + k, r);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const Vec xv = load_partial<DType::kFloat32>(x + m * x_stride + k, r);
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) acc[m][n] = fmadd(xv, wv[n], acc[m][n]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) {
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) out[m][n] = hsum(acc[m][n]);
  }
}

// Rows [n0, n0 + NB) of out for every input row; prefetches the NB weight
// rows after them, spread over the tiles.
template <DType D, int NB>
inline void row_block(storage_t<D>* out, int64_t out_stride, const float* x,
                      int64_t x_stride, const storage_t<D>* w,
                      const storage_t<D>* bias, int64_t n0, int64_t M,
                      int64_t K) {
  const storage_t<D>* wb = w + n0 * K;
  float b[NB];
  for (int n = 0; n < NB; ++n) b[n] = bias ? to_float<D>(bias[n0 + n]) : 0.0f;
  const char* next = reinterpret_cast<const char*>(wb + NB * K);
  const int64_t tiles = (M + kMaxTile - 1) / kMaxTile;
  const int64_t bytes_per_tile =
      (NB * K * static_cast<int64_t>(sizeof(storage_t<D>)) + tiles - 1) / tiles;
  auto run = [&](auto mb_constant, int64_t m0) {
    constexpr int MB = decltype(mb_constant)::value;
    const char* pf = next + (m0 / kMaxTile) * bytes_per_tile;
    float sums[MB][NB];
    tile<D, NB, MB>(wb, K, x + m0 * x_stride, x_stride, pf,
                    pf + bytes_per_tile, sums);
    for (int m = 0; m < MB; ++m) {
      storage_t<D>* o = out + (m0 + m) * out_stride + n0;
      for (int n = 0; n < NB; ++n) o[n] = from_float<D>(sums[m][n] + b[n]);
    }
  };
  int64_t m0 = 0;
  for (; m0 + kMaxTile <= M; m0 += kMaxTile) run(Int<kMaxTile>{}, m0);
  switch (M - m0) {
    case 3: run(Int<3>{}, m0); break;
    case 2: run(Int<2>{}, m0); break;
    case 1: run(Int<1>{}, m0); break;
    default: break;
  }
}

// Below this many multiply-adds the product runs on one thread.
constexpr int64_t kParallelMinMacs = 1 << 16;

template <DType D>
void linear_impl(void* out, int64_t out_stride, const void* input,
                 int64_t input_stride, const void* weight, const void* bias,
                 int64_t M, int64_t N, int64_t K) {
  using T = storage_t<D>;
  T* o = static_cast<T*>(out);
  const T* w = static_cast<const T*>(weight);
  const T* b = static_cast<const T*>(bias);

  // The input as fp32 rows.
  const float* x;
  int64_t x_stride;
  float* converted = nullptr;
  if constexpr (D == DType::kFloat32) {
    x = static_cast<const float*>(input);
    x_stride = input_stride;
  } else {
    converted = new float[M * K];
    const T* in = static_cast<const T*>(input);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) {
        converted[m * K + k] = to_float<D>(in[m * input_stride + k]);
      }
    }
    x = converted;
    x_stride = K;
  }

  const int64_t full_blocks = N / kRowBlock;
  const bool parallel = M * N * K >= kParallelMinMacs && full_blocks > 1;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (parallel)
#endif
  for (int64_t blk = 0; blk < full_blocks; ++blk) {
    row_block<D, kRowBlock>(o, out_stride, x, x_stride, w, b, blk * kRowBlock,
                            M, K);
  }
  (void)parallel;
  for (int64_t n = full_blocks * kRowBlock; n < N; ++n) {
    row_block<D, 1>(o, out_stride, x, x_stride, w, b, n, M, K);
  }
  delete[] converted;
}

}  // namespace

void linear(void* out, int64_t out_stride, const void* input,
            int64_t input_stride, const void* weight, const void* bias,
            int64_t M, int64_t N, int64_t K, DType dtype) {
  if (M <= 0 || N <= 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return linear_impl<DType::kFloat32>(out, out_stride, input, input_stride,
                                          weight, bias, M, N, K);
    case DType::kBFloat16:
      return linear_impl<DType::kBFloat16>(out, out_stride, input,
                                           input_stride, weight, bias, M, N, K);
    case DType::kFloat16:
      return linear_impl<DType::kFloat16>(out, out_stride, input, input_stride,
                                          weight, bias, M, N, K);
  }
}

}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
