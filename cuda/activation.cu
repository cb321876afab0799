// silu_and_mul (semantics: cc/cpu/kernels.h).
//
// x[t] = [gate (d) | up (d)]; out[t, i] = round(round(silu(gate[i])) * up[i])
// with silu(g) = g / (1 + expf(-g)) in fp32 (expf, not __expf, to stay close to
// the CPU path); this is what torch computes for F.silu(gate) * up in the
// tensor dtype.
//
// 2-D launch: threadIdx.x / blockIdx.x walk the columns of a row in Vec<T, V>
// units, threadIdx.y / blockIdx.y walk rows (grid-stride in y), so short rows
// still fill a block. V = 16 / sizeof(T) when x, out, d and both strides allow
// 16-byte accesses, else 1.

#include <climits>
#include <cstdint>

#include "cuda/kernels.h"

namespace pagoda {
namespace gpu {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// out may equal x (each output element overwrites the gate element at the same
// position of the same row, read before by the same thread).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    silu_and_mul_kernel(T* out, int64_t out_stride, const T* x,
                        int64_t x_stride, int64_t num_tokens, int n_vec,
                        int d) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= n_vec) return;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
       row < num_tokens; row += row_step) {
    const T* xr = x + row * x_stride;
    const Vec<T, V> g = load_vec<T, V>(xr + col * V);
    const Vec<T, V> u = load_vec<T, V>(xr + d + col * V);
    Vec<T, V> o{};
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float gf = g.get(j);
      const float s = round_to<T>(gf / (1.0f + expf(-gf)));
      o.set(j, s * u.get(j));
    }
    store_vec(out + row * out_stride + col * V, o);
  }
}

template <typename T, int V>
void launch(T* out, int64_t out_stride, const T* x, int64_t x_stride,
            int64_t num_tokens, int64_t d, cudaStream_t stream) {
  const int64_t n_vec = d / V;
  int bx = 1;
  while (bx < n_vec && bx < kThreads) bx *= 2;
  const int by = kThreads / bx;
  const int64_t gx = (n_vec + bx - 1) / bx;
  int64_t gy = (num_tokens + by - 1) / by;
  if (gy > kMaxGridY) gy = kMaxGridY;
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  const dim3 block(static_cast<unsigned>(bx), static_cast<unsigned>(by));
  silu_and_mul_kernel<T, V><<<grid, block, 0, stream>>>(
      out, out_stride, x, x_stride, num_tokens, static_cast<int>(n_vec),
      static_cast<int>(d));
}

template <typename T>
cudaError_t silu_and_mul_typed(void* out, int64_t out_stride, const void* x,
                               int64_t x_stride, int64_t num_tokens, int64_t d,
                               cudaStream_t stream) {
  constexpr int64_t kV = 16 / sizeof(T);
  T* o = static_cast<T*>(out);
  const T* xi = static_cast<const T*>(x);
  const bool vec = d % kV == 0 && is_aligned(out, 16) && is_aligned(x, 16) &&
                   (num_tokens == 1 ||
                    (out_stride % kV == 0 && x_stride % kV == 0));
  if (vec) {
    launch<T, static_cast<int>(kV)>(o, out_stride, xi, x_stride, num_tokens,
                                    d, stream);
  } else {
    launch<T, 1>(o, out_stride, xi, x_stride, num_tokens, d, stream);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t silu_and_mul(void* out, int64_t out_stride, const void* x,
                         int64_t x_stride, int64_t num_tokens, int64_t d,
                         DType dtype, cudaStream_t stream) {
  // 2 * d must fit the int column arithmetic (d + col * V).
  if (num_tokens < 0 || d < 0 || d > INT_MAX / 2) return cudaErrorInvalidValue;
  if (num_tokens == 0 || d == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return silu_and_mul_typed<float>(out, out_stride, x, x_stride,
                                       num_tokens, d, stream);
    case DType::kBFloat16:
      return silu_and_mul_typed<uint16_t>(out, out_stride, x, x_stride,
                                          num_tokens, d, stream);
    case DType::kFloat16:
      return silu_and_mul_typed<__half>(out, out_stride, x, x_stride,
                                        num_tokens, d, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace gpu
}  // namespace pagoda
