// reshape_and_cache (semantics: cc/cpu/kernels.h): copies each new token's key
// and value rows (num_kv_heads * head_size elements) into its slot of the
// paged KV cache. A pure copy, so only the element size matters: bf16 and
// fp16 both move as 16-bit words.
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

template <typename E, int V>
void launch(const void* key, int64_t key_stride, const void* value,
            int64_t value_stride, void* key_cache, void* value_cache,
            const int64_t* slot_mapping, int64_t num_tokens, int64_t num_slots,
            int64_t row_width, cudaStream_t stream) {
  const int64_t n_vec = row_width / V;
  int bx = PAGODA_MAX_WARP_SIZE;
  while (bx < n_vec && bx < kThreads) bx *= 2;
  const int by = kThreads / bx;
  int64_t grid = (num_tokens + by - 1) / by;
  if (grid > kMaxBlocks) grid = kMaxBlocks;
  reshape_and_cache_kernel<E, V>
      <<<static_cast<unsigned>(grid), dim3(bx, by), 0, stream>>>(
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

}  // namespace

cudaError_t reshape_and_cache(const void* key, int64_t key_stride,
                              const void* value, int64_t value_stride,
                              void* key_cache, void* value_cache,
                              const int64_t* slot_mapping, int64_t num_tokens,
                              int64_t num_slots, int64_t row_width,
                              DType dtype, cudaStream_t stream) {
  if (num_tokens < 0 || row_width < 0 || row_width > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0 || row_width == 0) return cudaSuccess;
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
