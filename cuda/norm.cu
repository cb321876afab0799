// RMSNorm and fused residual-add + RMSNorm (semantics: cc/cpu/kernels.h).
//
// One block per token row (grid-stride over rows), fp32 sum of squares reduced
// over the block. Rows are accessed in Vec<T, V> units: V = 16 / sizeof(T) when
// every pointer is 16-byte aligned and hidden and the strides are multiples of V,
// otherwise V = 1 (scalar, any size/stride). When a row has at most K vectors
// per thread (K in 1, 2, 4) they stay in registers between the reduction and
// the output pass; longer rows are read a second time (from L2).
//
// Rounding (Hugging Face LlamaRMSNorm): y = round(w * round(x * inv_rms)),
// inv_rms = 1 / sqrt(sum(x^2) / hidden + eps), all in fp32 (1/sqrtf, not the
// approximate rsqrtf, to match the CPU path).
// fused_add_rms_norm: r = round(x + residual) is stored to residual and the
// rounded r is what gets normalized.

#include <climits>
#include <cstdint>
#include <initializer_list>

#include "cuda/kernels.h"

namespace pagoda {
namespace gpu {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int64_t kMinThreads = 128;
// pick_shape launches K = 1 and K = 2 rows with at most 256 threads.
constexpr int max_threads_for(int k) { return k == 1 || k == 2 ? 256 : kMaxThreads; }
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// Sum of v over the block, returned to every thread. blockDim.x must be a
// multiple of PAGODA_WARP_SIZE and every thread of the block must call it.
__device__ __forceinline__ float block_reduce_sum(float v) {
  __shared__ float warp_sums[kMaxThreads / 32];
  __shared__ float total;
  const int lane = threadIdx.x % PAGODA_WARP_SIZE;
  const int warp = threadIdx.x / PAGODA_WARP_SIZE;
  v = warp_reduce_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int num_warps = blockDim.x / PAGODA_WARP_SIZE;
    float s = lane < num_warps ? warp_sums[lane] : 0.0f;
    s = warp_reduce_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

template <typename T, int V>
__device__ __forceinline__ float sum_squares(const Vec<T, V>& a) {
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float f = a.get(j);
    s += f * f;
  }
  return s;
}

// out = round(w * round(x * inv)).
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> scale(const Vec<T, V>& a,
                                           const Vec<T, V>& w, float inv) {
  Vec<T, V> o{};
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float n = round_to<T>(a.get(j) * inv);
    o.set(j, w.get(j) * n);
  }
  return o;
}

// residual = round(x + residual), elementwise.
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> add_round(const Vec<T, V>& a,
                                               const Vec<T, V>& b) {
  Vec<T, V> o{};
#pragma unroll
  for (int j = 0; j < V; ++j) o.set(j, a.get(j) + b.get(j));
  return o;
}

// The row value that gets normalized: x itself, or (kFused) round(x +
// residual), which is also stored back to residual.
template <typename T, int V, bool kFused>
__device__ __forceinline__ Vec<T, V> load_input(const T* xr, T* rr, int i) {
  const Vec<T, V> a = load_vec<T, V>(xr + i * V);
  if constexpr (!kFused) {
    return a;
  } else {
    const Vec<T, V> r = add_round(a, load_vec<T, V>(rr + i * V));
    store_vec(rr + i * V, r);
    return r;
  }
}

// One kernel for both ops: rms_norm (out = norm(x)) and, with kFused,
// fused_add_rms_norm (residual = x + residual; out = norm(residual), where the
// caller passes out = x).
// K > 0: the host guarantees n_vec <= K * blockDim.x; vector k of a thread is
// threadIdx.x + k * blockDim.x and is kept in registers. K == 0: any n_vec.
// out may equal x (each element is read before it is written, by one thread).
template <typename T, int V, int K, bool kFused>
__global__ void __launch_bounds__(max_threads_for(K))
    rms_norm_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                    T* residual, int64_t residual_stride,
                    const T* __restrict__ weight, int64_t num_tokens,
                    int n_vec, float hidden_f, float eps) {
  for (int64_t row = blockIdx.x; row < num_tokens; row += gridDim.x) {
    const T* xr = x + row * x_stride;
    T* rr = kFused ? residual + row * residual_stride : nullptr;
    T* outr = out + row * out_stride;
    float ss = 0.0f;
    if constexpr (K > 0) {
      Vec<T, V> cache[K];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n_vec) {
          cache[k] = load_input<T, V, kFused>(xr, rr, i);
          ss += sum_squares(cache[k]);
        }
      }
      const float inv = 1.0f / sqrtf(block_reduce_sum(ss) / hidden_f + eps);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n_vec) {
          store_vec(outr + i * V,
                    scale(cache[k], load_vec<T, V>(weight + i * V), inv));
        }
      }
    } else {
      for (int i = threadIdx.x; i < n_vec; i += blockDim.x) {
        ss += sum_squares(load_input<T, V, kFused>(xr, rr, i));
      }
      const float inv = 1.0f / sqrtf(block_reduce_sum(ss) / hidden_f + eps);
      // The normalized row is re-read: x, or the residual elements this very
      // thread wrote above.
      const T* normed = kFused ? rr : xr;
      for (int i = threadIdx.x; i < n_vec; i += blockDim.x) {
        store_vec(outr + i * V, scale(load_vec<T, V>(normed + i * V),
                                      load_vec<T, V>(weight + i * V), inv));
      }
    }
  }
}

bool is_aligned(const void* p, int64_t a) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a) == 0;
}

// Launch shape for n_vec vectors per row: K vectors per thread in registers
// (0: loop), threads a multiple of PAGODA_MAX_WARP_SIZE.
struct Shape {
  int k;
  int threads;
};

// Rows of up to 4 * kMaxThreads vectors stay in registers. Prefers several
// independent 16-byte loads per thread (more bytes in flight per SM before the
// block-wide reduction stalls the row) over more threads, keeping at least
// kMinThreads threads per row where the row is long enough.
Shape pick_shape(int64_t n_vec) {
  if (n_vec > int64_t{4} * kMaxThreads) return {0, kMaxThreads};
  const int64_t w = PAGODA_MAX_WARP_SIZE;
  for (int k : {4, 2}) {
    const int64_t per = (n_vec + k - 1) / k;
    if (per >= kMinThreads) return {k, static_cast<int>((per + w - 1) / w * w)};
  }
  return {1, static_cast<int>((n_vec + w - 1) / w * w)};
}

int grid_for(int64_t rows) {
  return static_cast<int>(rows < kMaxBlocks ? rows : kMaxBlocks);
}

template <typename T, int V, bool kFused>
void launch_rms_norm(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                     T* residual, int64_t residual_stride, const T* weight,
                     int64_t num_tokens, int64_t hidden, float eps,
                     cudaStream_t stream) {
  const int64_t n_vec = hidden / V;
  const Shape s = pick_shape(n_vec);
  const float hidden_f = static_cast<float>(hidden);
  const int grid = grid_for(num_tokens);
  const int n = static_cast<int>(n_vec);
  switch (s.k) {
#define PAGODA_CASE(K)                                                    \
  case K:                                                                 \
    rms_norm_kernel<T, V, K, kFused><<<grid, s.threads, 0, stream>>>(     \
        out, out_stride, x, x_stride, residual, residual_stride, weight,  \
        num_tokens, n, hidden_f, eps);                                    \
    break;
    PAGODA_CASE(1)
    PAGODA_CASE(2)
    PAGODA_CASE(4)
    default:
    PAGODA_CASE(0)
#undef PAGODA_CASE
  }
}

// Whether rows can be accessed as 16-byte vectors of T.
template <typename T>
bool can_vectorize(int64_t num_tokens, int64_t hidden,
                   std::initializer_list<const void*> ptrs,
                   std::initializer_list<int64_t> strides) {
  constexpr int64_t kV = 16 / sizeof(T);
  if (hidden % kV != 0) return false;
  for (const void* p : ptrs) {
    if (!is_aligned(p, 16)) return false;
  }
  if (num_tokens > 1) {
    for (int64_t st : strides) {
      if (st % kV != 0) return false;
    }
  }
  return true;
}

// residual == nullptr: rms_norm; otherwise fused_add_rms_norm (out == x).
template <typename T, bool kFused>
cudaError_t rms_norm_typed(void* out, int64_t out_stride, const void* x,
                           int64_t x_stride, void* residual,
                           int64_t residual_stride, const void* weight,
                           int64_t num_tokens, int64_t hidden, float eps,
                           cudaStream_t stream) {
  T* o = static_cast<T*>(out);
  const T* xi = static_cast<const T*>(x);
  T* r = static_cast<T*>(residual);
  const T* w = static_cast<const T*>(weight);
  const bool vectorize =
      kFused ? can_vectorize<T>(num_tokens, hidden, {x, residual, weight},
                                {x_stride, residual_stride})
             : can_vectorize<T>(num_tokens, hidden, {out, x, weight},
                                {out_stride, x_stride});
  if (vectorize) {
    launch_rms_norm<T, 16 / sizeof(T), kFused>(o, out_stride, xi, x_stride, r,
                                               residual_stride, w, num_tokens,
                                               hidden, eps, stream);
  } else {
    launch_rms_norm<T, 1, kFused>(o, out_stride, xi, x_stride, r,
                                  residual_stride, w, num_tokens, hidden, eps,
                                  stream);
  }
  return cudaGetLastError();
}

template <bool kFused>
cudaError_t rms_norm_dispatch(void* out, int64_t out_stride, const void* x,
                              int64_t x_stride, void* residual,
                              int64_t residual_stride, const void* weight,
                              int64_t num_tokens, int64_t hidden, float eps,
                              DType dtype, cudaStream_t stream) {
  if (num_tokens < 0 || hidden < 0 || hidden > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return rms_norm_typed<float, kFused>(out, out_stride, x, x_stride,
                                           residual, residual_stride, weight,
                                           num_tokens, hidden, eps, stream);
    case DType::kBFloat16:
      return rms_norm_typed<uint16_t, kFused>(out, out_stride, x, x_stride,
                                              residual, residual_stride,
                                              weight, num_tokens, hidden, eps,
                                              stream);
    case DType::kFloat16:
      return rms_norm_typed<__half, kFused>(out, out_stride, x, x_stride,
                                            residual, residual_stride, weight,
                                            num_tokens, hidden, eps, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t rms_norm(void* out, int64_t out_stride, const void* x,
                     int64_t x_stride, const void* weight, int64_t num_tokens,
                     int64_t hidden, float eps, DType dtype,
                     cudaStream_t stream) {
  return rms_norm_dispatch<false>(out, out_stride, x, x_stride, nullptr, 0,
                                  weight, num_tokens, hidden, eps, dtype,
                                  stream);
}

cudaError_t fused_add_rms_norm(void* x, int64_t x_stride, void* residual,
                               int64_t residual_stride, const void* weight,
                               int64_t num_tokens, int64_t hidden, float eps,
                               DType dtype, cudaStream_t stream) {
  return rms_norm_dispatch<true>(x, x_stride, x, x_stride, residual,
                                 residual_stride, weight, num_tokens, hidden,
                                 eps, dtype, stream);
}

}  // namespace gpu
}  // namespace pagoda
