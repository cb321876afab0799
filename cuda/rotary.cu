// rotary_embedding (semantics: cc/cpu/kernels.h), in place on query and key.
//
// cos_sin_cache row p = [cos (rot_dim/2) | sin (rot_dim/2)] in cache dtype C
// (the query dtype or fp32). For pair i (0 <= i < embed = rot_dim/2):
//   NeoX:  x1 = x[i],      x2 = x[i + embed]
//   GPT-J: x1 = x[2i],     x2 = x[2i + 1]
//   x1' = round(x1 * cos[i] - x2 * sin[i]); x2' = round(x2 * cos[i] + x1 * sin[i])
// in fp32, rounded once per output. Elements rot_dim..head_size are untouched.
// The fp32 arithmetic is spelled out as fma(x1, cos, -(x2 * sin)) and
// fma(x2, cos, x1 * sin) with the inner product rounded (__fmul_rn, never
// contracted), which is exactly what the CPU path's fmsub/fmadd/fmaddsub do,
// so fp32 results match it bit for bit.
//
// A work item is P consecutive pairs of one head: NeoX loads P elements from
// each half, GPT-J 2P interleaved elements, plus P cos and P sin values.
// P is the widest of 8/4/2 that divides embed and for which every pointer,
// stride and offset is aligned (see pairs_ok); otherwise P = 1, which uses
// element-sized accesses only (any layout). 2-D launch: threadIdx.x walks
// the items of a token (all query heads, then all key heads), threadIdx.y and
// blockIdx.x walk tokens (grid-stride).

#include <climits>
#include <cstdint>

#include "cuda/kernels.h"

namespace pagoda {
namespace gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxItemThreads = 512;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

template <typename T, typename C, bool kNeox, int P>
__global__ void __launch_bounds__(kMaxItemThreads)
    rotary_kernel(const int64_t* __restrict__ positions, T* query,
                  int64_t query_stride, T* key, int64_t key_stride,
                  int64_t num_tokens, int num_heads, int num_kv_heads,
                  int head_size, const C* __restrict__ cos_sin_cache,
                  int rot_dim) {
  const int embed = rot_dim / 2;
  const int groups = embed / P;  // items per head
  const int q_items = num_heads * groups;
  const int items = q_items + (key != nullptr ? num_kv_heads * groups : 0);
  const int64_t token_step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
       t < num_tokens; t += token_step) {
    const C* cos_ptr = cos_sin_cache + positions[t] * rot_dim;
    const C* sin_ptr = cos_ptr + embed;
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
      T* head_ptr;
      int rel;
      if (item < q_items) {
        rel = item;
        head_ptr = query + t * query_stride;
      } else {
        rel = item - q_items;
        head_ptr = key + t * key_stride;
      }
      const int head = rel / groups;
      const int p0 = (rel - head * groups) * P;  // first pair of this item
      head_ptr += static_cast<int64_t>(head) * head_size;

      const Vec<C, P> c = load_vec<C, P>(cos_ptr + p0);
      const Vec<C, P> s = load_vec<C, P>(sin_ptr + p0);
      if constexpr (kNeox) {
        Vec<T, P> a = load_vec<T, P>(head_ptr + p0);
        Vec<T, P> b = load_vec<T, P>(head_ptr + embed + p0);
#pragma unroll
        for (int j = 0; j < P; ++j) {
          const float cf = c.get(j);
          const float sf = s.get(j);
          const float x1 = a.get(j);
          const float x2 = b.get(j);
          a.set(j, fmaf(x1, cf, -__fmul_rn(x2, sf)));
          b.set(j, fmaf(x2, cf, __fmul_rn(x1, sf)));
        }
        store_vec(head_ptr + p0, a);
        store_vec(head_ptr + embed + p0, b);
      } else if constexpr (P == 1) {
        // Scalar fallback: the pair is accessed element by element since
        // head_ptr + 2 * p0 need not be aligned to two elements.
        T* x = head_ptr + 2 * p0;
        const float cf = c.get(0);
        const float sf = s.get(0);
        const float x1 = to_float(x[0]);
        const float x2 = to_float(x[1]);
        x[0] = from_float<T>(fmaf(x1, cf, -__fmul_rn(x2, sf)));
        x[1] = from_float<T>(fmaf(x2, cf, __fmul_rn(x1, sf)));
      } else {
        Vec<T, 2 * P> a = load_vec<T, 2 * P>(head_ptr + 2 * p0);
#pragma unroll
        for (int j = 0; j < P; ++j) {
          const float cf = c.get(j);
          const float sf = s.get(j);
          const float x1 = a.get(2 * j);
          const float x2 = a.get(2 * j + 1);
          a.set(2 * j, fmaf(x1, cf, -__fmul_rn(x2, sf)));
          a.set(2 * j + 1, fmaf(x2, cf, __fmul_rn(x1, sf)));
        }
        store_vec(head_ptr + 2 * p0, a);
      }
    }
  }
}

struct Args {
  const int64_t* positions;
  void* query;
  int64_t query_stride;
  void* key;
  int64_t key_stride;
  int64_t num_tokens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  const void* cache;
  int64_t rot_dim;
};

// Whether P pairs per item give aligned Vec accesses for element type T and
// cache type C.
template <typename T, typename C, bool kNeox, int P>
bool pairs_ok(const Args& a) {
  const int64_t embed = a.rot_dim / 2;
  if (embed % P != 0) return false;
  // x accesses are P (NeoX) or 2P (GPT-J) elements at element offsets that are
  // multiples of that count within a head; embed % P == 0 covers the NeoX
  // second half. What remains: the base pointers, the head size and the token
  // strides.
  constexpr int kXElems = kNeox ? P : 2 * P;
  constexpr int kXAlign = vec_align<T, kXElems>();
  const int64_t x_unit = kXAlign / static_cast<int64_t>(sizeof(T));
  auto x_ok = [&](const void* p, int64_t stride, int64_t heads) {
    return is_aligned(p, kXAlign) && (heads <= 1 || a.head_size % x_unit == 0) &&
           (a.num_tokens <= 1 || stride % x_unit == 0);
  };
  if (!x_ok(a.query, a.query_stride, a.num_heads)) return false;
  if (a.key != nullptr && !x_ok(a.key, a.key_stride, a.num_kv_heads)) {
    return false;
  }
  // Cache rows are rot_dim = 2 * embed elements (a multiple of 2P) apart and
  // sin starts embed elements in, so only the base pointer needs checking.
  return is_aligned(a.cache, vec_align<C, P>());
}

int64_t next_pow2_capped(int64_t n, int64_t cap) {
  int64_t b = 1;
  while (b < n && b < cap) b *= 2;
  return b;
}

template <typename T, typename C, bool kNeox, int P>
void launch(const Args& a, cudaStream_t stream) {
  const int64_t embed = a.rot_dim / 2;
  const int64_t groups = embed / P;
  const int64_t items =
      (a.num_heads + (a.key != nullptr ? a.num_kv_heads : 0)) * groups;
  const int64_t bx = next_pow2_capped(items, kMaxItemThreads);
  const int64_t by = bx >= kThreads ? 1 : kThreads / bx;
  int64_t blocks = (a.num_tokens + by - 1) / by;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  const dim3 block(static_cast<unsigned>(bx), static_cast<unsigned>(by));
  rotary_kernel<T, C, kNeox, P>
      <<<static_cast<unsigned>(blocks), block, 0, stream>>>(
          a.positions, static_cast<T*>(a.query), a.query_stride,
          static_cast<T*>(a.key), a.key_stride, a.num_tokens,
          static_cast<int>(a.num_heads), static_cast<int>(a.num_kv_heads),
          static_cast<int>(a.head_size), static_cast<const C*>(a.cache),
          static_cast<int>(a.rot_dim));
}

template <typename T, typename C, bool kNeox>
void dispatch_pairs(const Args& a, cudaStream_t stream) {
  // Widest x access is 16 bytes: NeoX P * sizeof(T), GPT-J 2P * sizeof(T).
  constexpr int kMaxP = (kNeox ? 16 : 8) / static_cast<int>(sizeof(T));
  if constexpr (kMaxP >= 8) {
    if (pairs_ok<T, C, kNeox, 8>(a)) return launch<T, C, kNeox, 8>(a, stream);
  }
  if constexpr (kMaxP >= 4) {
    if (pairs_ok<T, C, kNeox, 4>(a)) return launch<T, C, kNeox, 4>(a, stream);
  }
  if constexpr (kMaxP >= 2) {
    if (pairs_ok<T, C, kNeox, 2>(a)) return launch<T, C, kNeox, 2>(a, stream);
  }
  launch<T, C, kNeox, 1>(a, stream);
}

template <typename T, typename C>
cudaError_t rotary_typed(const Args& a, bool is_neox, cudaStream_t stream) {
  if (is_neox) {
    dispatch_pairs<T, C, true>(a, stream);
  } else {
    dispatch_pairs<T, C, false>(a, stream);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t rotary_embedding(const int64_t* positions, void* query,
                             int64_t query_stride, void* key,
                             int64_t key_stride, int64_t num_tokens,
                             int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_size, const void* cos_sin_cache,
                             int64_t rot_dim, bool is_neox, DType dtype,
                             DType cache_dtype, cudaStream_t stream) {
  if (num_tokens < 0 || num_heads < 0 || num_kv_heads < 0 || head_size < 0 ||
      rot_dim < 0 || rot_dim % 2 != 0 || rot_dim > head_size ||
      rot_dim > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  // Per-token item counts and head offsets are int in the kernel.
  const int64_t heads = num_heads + (key != nullptr ? num_kv_heads : 0);
  if (heads * head_size > INT_MAX) return cudaErrorInvalidValue;
  if (num_tokens == 0 || rot_dim == 0 || heads == 0) return cudaSuccess;
  const Args a{positions, query,     query_stride, key,           key_stride,
               num_tokens, num_heads, num_kv_heads, head_size, cos_sin_cache,
               rot_dim};
  if (cache_dtype == DType::kFloat32) {
    switch (dtype) {
      case DType::kFloat32:
        return rotary_typed<float, float>(a, is_neox, stream);
      case DType::kBFloat16:
        return rotary_typed<uint16_t, float>(a, is_neox, stream);
      case DType::kFloat16:
        return rotary_typed<__half, float>(a, is_neox, stream);
    }
  } else if (cache_dtype == dtype) {
    switch (dtype) {
      case DType::kFloat32:
        break;  // handled above
      case DType::kBFloat16:
        return rotary_typed<uint16_t, uint16_t>(a, is_neox, stream);
      case DType::kFloat16:
        return rotary_typed<__half, __half>(a, is_neox, stream);
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace gpu
}  // namespace pagoda
