// reshape_and_cache (semantics: cc/cpu/kernels.h): copies each new token's key
// and value rows (num_kv_heads * head_size elements) into its slot of the
// paged KV cache. A pure copy, so only the element size matters: bf16 and
// fp16 both move as 16-bit words. A float8 cache (--kv-cache-dtype fp8, CUDA
// only) takes each bf16/fp16 value rounded to e4m3 with unit scale, saturated
// to +-448 (vLLM's default scale; the attention kernel reads it back exactly).
//
// 2-D launch: threadIdx.x walks a row in units of Vec<E, V>, threadIdx.y (and
// blockIdx.x, grid-stride) walks tokens, so short rows still fill a block. V =
// 16 / sizeof(E) (16-byte accesses) when every pointer, the row width and the
// strides allow it, otherwise 1.
//
// Slots are not range-checked on the host (that would need a device sync);
// tokens with a negative slot (padding) or one past the cache's end are
// skipped, so a bad slot never writes out of bounds.

#include <climits>
#include <cstdint>

#include "cuda/kernels.h"

#if !PAGODA_HIP
#include <cuda_fp8.h>
#endif

namespace pagoda {
namespace gpu {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

template <typename E, int V>
__global__ void __launch_bounds__(kThreads)
    reshape_and_cache_kernel(const E* __restrict__ key, int64_t key_stride,
                             const E* __restrict__ value, int64_t value_stride,
                             E* __restrict__ key_cache,
                             E* __restrict__ value_cache,
                             const int64_t* __restrict__ slot_mapping,
                             int64_t num_tokens, int64_t num_slots, int n_vec,
                             int64_t row_width) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
       t < num_tokens; t += step) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) continue;
    const E* k = key + t * key_stride;
    const E* v = value + t * value_stride;
    E* kc = key_cache + slot * row_width;
    E* vc = value_cache + slot * row_width;
    for (int i = threadIdx.x; i < n_vec; i += blockDim.x) {
      // Both loads before both stores: two requests in flight per thread.
      const Vec<E, V> kv = load_vec<E, V>(k + i * V);
      const Vec<E, V> vv = load_vec<E, V>(v + i * V);
      store_vec(kc + i * V, kv);
      store_vec(vc + i * V, vv);
    }
  }
}

#if !PAGODA_HIP
template <typename E>
__device__ __forceinline__ float bits_to_float(uint32_t bits) {
  if constexpr (std::is_same_v<E, __half>) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  } else {
    return bf16_to_float(static_cast<uint16_t>(bits));
  }
}

// Eight bf16/fp16 values (one 16-byte word) as eight e4m3 bytes.
template <typename E>
__device__ __forceinline__ uint2 to_e4m3x8(const uint4 in) {
  const uint32_t words[4] = {in.x, in.y, in.z, in.w};
  uint32_t out[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t w = words[2 * i + j];
      const float2 f = make_float2(bits_to_float<E>(w & 0xffffu),
                                   bits_to_float<E>(w >> 16));
      const uint32_t pair =
          __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3);
      packed |= pair << (16 * j);
    }
    out[i] = packed;
  }
  return make_uint2(out[0], out[1]);
}

// The copy into a float8 cache, 8 values at a time (row widths, strides and
// pointers checked for 16-byte input words on the host).
template <typename E>
__global__ void __launch_bounds__(kThreads)
    reshape_and_cache_fp8_kernel(const uint16_t* __restrict__ key,
                                 int64_t key_stride,
                                 const uint16_t* __restrict__ value,
                                 int64_t value_stride,
                                 uint8_t* __restrict__ key_cache,
                                 uint8_t* __restrict__ value_cache,
                                 const int64_t* __restrict__ slot_mapping,
                                 int64_t num_tokens, int64_t num_slots,
                                 int n_vec, int64_t row_width) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
       t < num_tokens; t += step) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) continue;
    const uint4* k = reinterpret_cast<const uint4*>(key + t * key_stride);
    const uint4* v = reinterpret_cast<const uint4*>(value + t * value_stride);
    uint2* kc = reinterpret_cast<uint2*>(key_cache + slot * row_width);
    uint2* vc = reinterpret_cast<uint2*>(value_cache + slot * row_width);
    for (int i = threadIdx.x; i < n_vec; i += blockDim.x) {
      const uint4 kv = k[i], vv = v[i];
      kc[i] = to_e4m3x8<E>(kv);
      vc[i] = to_e4m3x8<E>(vv);
    }
  }
}
#endif  // !PAGODA_HIP

// Threads per row (a power of two from the warp size up) and rows per block
// for rows of n_vec vectors, and the grid over num_tokens rows.
struct Shape {
  dim3 block;
  unsigned grid;
};

Shape launch_shape(int64_t n_vec, int64_t num_tokens) {
  int bx = PAGODA_MAX_WARP_SIZE;
  while (bx < n_vec && bx < kThreads) bx *= 2;
  const int by = kThreads / bx;
  int64_t grid = (num_tokens + by - 1) / by;
  if (grid > kMaxBlocks) grid = kMaxBlocks;
  return Shape{dim3(bx, by), static_cast<unsigned>(grid)};
}

template <typename E, int V>
void launch(const void* key, int64_t key_stride, const void* value,
            int64_t value_stride, void* key_cache, void* value_cache,
            const int64_t* slot_mapping, int64_t num_tokens, int64_t num_slots,
            int64_t row_width, cudaStream_t stream) {
  const int64_t n_vec = row_width / V;
  const Shape shape = launch_shape(n_vec, num_tokens);
  reshape_and_cache_kernel<E, V><<<shape.grid, shape.block, 0, stream>>>(
          static_cast<const E*>(key), key_stride,
          static_cast<const E*>(value), value_stride,
          static_cast<E*>(key_cache), static_cast<E*>(value_cache),
          slot_mapping, num_tokens, num_slots, static_cast<int>(n_vec),
          row_width);
}

template <typename E>
cudaError_t reshape_and_cache_typed(const void* key, int64_t key_stride,
                                    const void* value, int64_t value_stride,
                                    void* key_cache, void* value_cache,
                                    const int64_t* slot_mapping,
                                    int64_t num_tokens, int64_t num_slots,
                                    int64_t row_width, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(E);
  const bool vec = row_width % kV == 0 && key_stride % kV == 0 &&
                   value_stride % kV == 0 && is_aligned(key, 16) &&
                   is_aligned(value, 16) && is_aligned(key_cache, 16) &&
                   is_aligned(value_cache, 16);
  if (vec) {
    launch<E, kV>(key, key_stride, value, value_stride, key_cache, value_cache,
                  slot_mapping, num_tokens, num_slots, row_width, stream);
  } else {
    launch<E, 1>(key, key_stride, value, value_stride, key_cache, value_cache,
                 slot_mapping, num_tokens, num_slots, row_width, stream);
  }
  return cudaGetLastError();
}

cudaError_t reshape_and_cache_fp8(const void* key, int64_t key_stride,
                                  const void* value, int64_t value_stride,
                                  void* key_cache, void* value_cache,
                                  const int64_t* slot_mapping,
                                  int64_t num_tokens, int64_t num_slots,
                                  int64_t row_width, DType dtype,
                                  cudaStream_t stream) {
#if PAGODA_HIP
  return cudaErrorInvalidValue;
#else
  const bool vec = row_width % 8 == 0 && key_stride % 8 == 0 &&
                   value_stride % 8 == 0 && is_aligned(key, 16) &&
                   is_aligned(value, 16) && is_aligned(key_cache, 8) &&
                   is_aligned(value_cache, 8);
  if (!vec || dtype == DType::kFloat32) return cudaErrorInvalidValue;
  const int64_t n_vec = row_width / 8;
  const Shape shape = launch_shape(n_vec, num_tokens);
  auto kernel = dtype == DType::kFloat16 ? reshape_and_cache_fp8_kernel<__half>
                                         : reshape_and_cache_fp8_kernel<uint16_t>;
  kernel<<<shape.grid, shape.block, 0, stream>>>(
      static_cast<const uint16_t*>(key), key_stride,
      static_cast<const uint16_t*>(value), value_stride,
      static_cast<uint8_t*>(key_cache), static_cast<uint8_t*>(value_cache),
      slot_mapping, num_tokens, num_slots, static_cast<int>(n_vec), row_width);
  return cudaGetLastError();
#endif
}

}  // namespace

cudaError_t reshape_and_cache(const void* key, int64_t key_stride,
                              const void* value, int64_t value_stride,
                              void* key_cache, void* value_cache,
                              const int64_t* slot_mapping, int64_t num_tokens,
                              int64_t num_slots, int64_t row_width,
                              DType dtype, bool to_fp8, cudaStream_t stream) {
  if (num_tokens < 0 || row_width < 0 || row_width > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0 || row_width == 0) return cudaSuccess;
  if (to_fp8) {
    return reshape_and_cache_fp8(key, key_stride, value, value_stride,
                                 key_cache, value_cache, slot_mapping,
                                 num_tokens, num_slots, row_width, dtype,
                                 stream);
  }
  switch (dtype) {
    case DType::kFloat32:
      return reshape_and_cache_typed<float>(
          key, key_stride, value, value_stride, key_cache, value_cache,
          slot_mapping, num_tokens, num_slots, row_width, stream);
    case DType::kBFloat16:
    case DType::kFloat16:
      return reshape_and_cache_typed<uint16_t>(
          key, key_stride, value, value_stride, key_cache, value_cache,
          slot_mapping, num_tokens, num_slots, row_width, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace gpu
}  // namespace pagoda
