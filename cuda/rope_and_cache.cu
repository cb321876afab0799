// rope_and_cache (semantics: python/pagoda/ops.py): in one launch, what
// rms_norm over each head of query and key (when their weights are given),
// rotary_embedding and reshape_and_cache do one after the other. A decode
// step runs it once per layer where the three ops took up to six launches
// (Qwen3: two head-norms with their copies out of the fused qkv output).
//
// One warp per (token, head): query heads, then key heads, then value heads.
// A query or key head is read once into the warp's slice of shared memory,
// normalized there (the sum of squares reduced over the warp), and rotated
// from it into its place in query/key; a key head also goes to its cache
// slot, as does a value head (a plain copy). Rounding is that of the
// separate kernels: the norm's y = round(w * round(x * inv_rms)) and the
// rotation's round(fma(x1, cos, -(x2 * sin))) / round(fma(x2, cos, x1 * sin))
// on the rounded normed values (cuda/norm.cu, cuda/rotary.cu); a float8
// cache takes the rounded rotated key as reshape_and_cache does (e4m3, unit
// scale, saturating). Only the order of the sum of squares differs from
// norm.cu, which can move inv_rms by an ulp.
//
// Tokens whose slot is negative or past the cache's end are rotated but not
// cached (reshape_and_cache's rule).

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
constexpr int kMaxWarpsPerBlock = kThreads / 32;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// V values of T, already rounded to T, into the cache at c: as T (one
// V-wide store), or as e4m3 bytes (unit scale, saturating; one V-byte store).
template <typename T, bool kFp8, int V>
struct CacheStore;
template <typename T, int V>
struct CacheStore<T, false, V> {
  using Elem = T;
  __device__ __forceinline__ static void store(T* c, const Vec<T, V>& v) {
    store_vec(c, v);
  }
};
#if !PAGODA_HIP
template <typename T, int V>
struct CacheStore<T, true, V> {
  using Elem = uint8_t;
  __device__ __forceinline__ static void store(uint8_t* c, const Vec<T, V>& v) {
    if constexpr (V == 1) {
      *c = static_cast<uint8_t>(
          __nv_cvt_float_to_fp8(v.get(0), __NV_SATFINITE, __NV_E4M3));
    } else {
      // Two values a conversion; V bytes in one store (V <= 8).
      uint32_t words[(V + 3) / 4] = {};
#pragma unroll
      for (int j = 0; j < V; j += 2) {
        const uint32_t pair = __nv_cvt_float2_to_fp8x2(
            make_float2(v.get(j), v.get(j + 1)), __NV_SATFINITE, __NV_E4M3);
        words[j / 4] |= pair << (8 * (j % 4));
      }
      if constexpr (V == 2) {
        *reinterpret_cast<uint16_t*>(c) = static_cast<uint16_t>(words[0]);
      } else if constexpr (V == 4) {
        *reinterpret_cast<uint32_t*>(c) = words[0];
      } else {
        *reinterpret_cast<uint2*>(c) = make_uint2(words[0], words[1]);
      }
    }
  }
};
#endif

// Each lane moves V consecutive elements of a head at a time (V-wide loads
// and stores; the host picks the widest V that the head size, strides and
// pointers allow and that still gives every lane work: 4 for bf16 heads of
// 128); per-element arithmetic is the same for every V.
template <typename T, typename C, bool kNeox, bool kFp8, int V>
__global__ void __launch_bounds__(kThreads)
    rope_and_cache_kernel(const RopeAndCacheParams p) {
  using Cache = CacheStore<T, kFp8, V>;
  using E = typename Cache::Elem;
  extern __shared__ float smem[];
  const int lane = threadIdx.x % PAGODA_WARP_SIZE;
  const int warp = threadIdx.x / PAGODA_WARP_SIZE;
  const int warps_per_block = blockDim.x / PAGODA_WARP_SIZE;
  float* buf = smem + warp * p.head_size;
  const int head_size = static_cast<int>(p.head_size);
  const int embed = static_cast<int>(p.rot_dim / 2);
  const int nq = static_cast<int>(p.num_heads);
  const int nkv = static_cast<int>(p.num_kv_heads);
  const int heads = nq + 2 * nkv;
  const int64_t jobs = p.num_tokens * heads;
  const int64_t row_width = p.num_kv_heads * p.head_size;
  const int64_t step = static_cast<int64_t>(gridDim.x) * warps_per_block;
  const int first = lane * V;
  constexpr int kStride = PAGODA_WARP_SIZE * V;
  for (int64_t job = static_cast<int64_t>(blockIdx.x) * warps_per_block + warp;
       job < jobs; job += step) {
    const int64_t t = job / heads;
    const int h = static_cast<int>(job - t * heads);
    const int64_t slot = p.slot_mapping[t];
    const bool cached = slot >= 0 && slot < p.num_slots;
    if (h >= nq + nkv) {  // a value head: to the cache only
      if (!cached) continue;
      const int kvh = h - nq - nkv;
      const T* v = static_cast<const T*>(p.value) + t * p.value_stride +
                   static_cast<int64_t>(kvh) * head_size;
      E* vc = static_cast<E*>(p.value_cache) + slot * row_width +
              static_cast<int64_t>(kvh) * head_size;
      for (int i = first; i < head_size; i += kStride) {
        Cache::store(vc + i, load_vec<T, V>(v + i));
      }
      continue;
    }
    const bool is_q = h < nq;
    const int head = is_q ? h : h - nq;
    T* x = static_cast<T*>(is_q ? p.query : p.key) +
           t * (is_q ? p.query_stride : p.key_stride) +
           static_cast<int64_t>(head) * head_size;
    const T* w = static_cast<const T*>(is_q ? p.q_norm_weight : p.k_norm_weight);
    float ss = 0.0f;
    for (int i = first; i < head_size; i += kStride) {
      const Vec<T, V> in = load_vec<T, V>(x + i);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float f = in.get(j);
        buf[i + j] = f;
        ss += f * f;
      }
    }
    if (w != nullptr) {
      const float inv =
          1.0f / sqrtf(warp_reduce_sum(ss) / static_cast<float>(head_size) +
                       p.eps);
      for (int i = first; i < head_size; i += kStride) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          buf[i + j] = round_to<T>(to_float(w[i + j]) * round_to<T>(buf[i + j] * inv));
        }
      }
    }
    warp_sync();
    const C* cos_ptr = static_cast<const C*>(p.cos_sin_cache) +
                       p.positions[t] * p.rot_dim;
    const C* sin_ptr = cos_ptr + embed;
    E* kc = is_q || !cached ? nullptr
                            : static_cast<E*>(p.key_cache) + slot * row_width +
                                  static_cast<int64_t>(head) * head_size;
    for (int i0 = first; i0 < head_size; i0 += kStride) {
      Vec<T, V> out{};
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int i = i0 + j;
        float y = buf[i];
        if (i < 2 * embed) {
          // The pair (x1, x2) this element belongs to, and which of the two it is.
          const int pair = kNeox ? (i < embed ? i : i - embed) : i / 2;
          const bool first_of_pair = kNeox ? i < embed : (i & 1) == 0;
          const int i1 = kNeox ? pair : 2 * pair;
          const int i2 = kNeox ? pair + embed : 2 * pair + 1;
          const float x1 = buf[i1], x2 = buf[i2];
          const float c = to_float(cos_ptr[pair]), s = to_float(sin_ptr[pair]);
          y = first_of_pair ? fmaf(x1, c, -__fmul_rn(x2, s))
                            : fmaf(x2, c, __fmul_rn(x1, s));
        }
        out.set(j, y);
      }
      store_vec(x + i0, out);
      if (kc != nullptr) Cache::store(kc + i0, out);
    }
    // The next job reuses buf: every lane must be done reading it.
    warp_sync();
  }
}

template <typename T, typename C, bool kNeox, bool kFp8, int V>
void launch(const RopeAndCacheParams& p, cudaStream_t stream) {
  const int64_t jobs = p.num_tokens * (p.num_heads + 2 * p.num_kv_heads);
  // Warps per block on the smallest warp size: enough shared memory for every
  // warp whatever the device's warp size is.
  int64_t blocks = (jobs + kMaxWarpsPerBlock - 1) / kMaxWarpsPerBlock;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  const size_t smem = sizeof(float) * kMaxWarpsPerBlock * p.head_size;
  rope_and_cache_kernel<T, C, kNeox, kFp8, V>
      <<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
}

// Whether V-element accesses fit this call: the head size a multiple of V and
// at least 32 of them (every lane of a 32-wide warp busy; a wider wavefront
// leaves some idle), and every row start aligned to V elements of T (the
// cache's: of its element, T or an e4m3 byte).
template <typename T>
bool vector_fits(const RopeAndCacheParams& p, bool to_fp8, int v) {
  const int64_t bytes = v * static_cast<int64_t>(sizeof(T));
  const int64_t cache_bytes = to_fp8 ? v : bytes;
  return p.head_size % v == 0 && p.head_size >= 32 * v &&
         p.query_stride % v == 0 && p.key_stride % v == 0 &&
         p.value_stride % v == 0 && is_aligned(p.query, bytes) &&
         is_aligned(p.key, bytes) && is_aligned(p.value, bytes) &&
         is_aligned(p.key_cache, cache_bytes) &&
         is_aligned(p.value_cache, cache_bytes);
}

template <typename T, typename C, bool kNeox, bool kFp8>
void launch_widest(const RopeAndCacheParams& p, cudaStream_t stream) {
  if (vector_fits<T>(p, kFp8, 8)) {
    launch<T, C, kNeox, kFp8, 8>(p, stream);
  } else if (vector_fits<T>(p, kFp8, 4)) {
    launch<T, C, kNeox, kFp8, 4>(p, stream);
  } else if (vector_fits<T>(p, kFp8, 2)) {
    launch<T, C, kNeox, kFp8, 2>(p, stream);
  } else {
    launch<T, C, kNeox, kFp8, 1>(p, stream);
  }
}

template <typename T, typename C>
cudaError_t rope_and_cache_typed(const RopeAndCacheParams& p, bool is_neox,
                                 bool to_fp8, cudaStream_t stream) {
  if (to_fp8) {
#if PAGODA_HIP
    return cudaErrorInvalidValue;
#else
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;  // float8 caches hold bf16/fp16 models' K/V
    } else {
      is_neox ? launch_widest<T, C, true, true>(p, stream)
              : launch_widest<T, C, false, true>(p, stream);
    }
#endif
  } else {
    is_neox ? launch_widest<T, C, true, false>(p, stream)
            : launch_widest<T, C, false, false>(p, stream);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t rope_and_cache(const RopeAndCacheParams& p, bool is_neox,
                           DType dtype, DType cos_sin_dtype, bool to_fp8,
                           cudaStream_t stream) {
  if (p.num_tokens < 0 || p.num_heads < 0 || p.num_kv_heads < 0 ||
      p.head_size <= 0 || p.head_size > kRopeAndCacheMaxHeadSize ||
      p.rot_dim < 0 || p.rot_dim % 2 != 0 || p.rot_dim > p.head_size ||
      p.num_heads + 2 * p.num_kv_heads > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tokens == 0 || p.num_heads + p.num_kv_heads == 0) {
    return cudaSuccess;
  }
  if (cos_sin_dtype == DType::kFloat32) {
    switch (dtype) {
      case DType::kFloat32:
        return rope_and_cache_typed<float, float>(p, is_neox, to_fp8, stream);
      case DType::kBFloat16:
        return rope_and_cache_typed<uint16_t, float>(p, is_neox, to_fp8, stream);
      case DType::kFloat16:
        return rope_and_cache_typed<__half, float>(p, is_neox, to_fp8, stream);
    }
  } else if (cos_sin_dtype == dtype) {
    switch (dtype) {
      case DType::kFloat32:
        break;  // handled above
      case DType::kBFloat16:
        return rope_and_cache_typed<uint16_t, uint16_t>(p, is_neox, to_fp8,
                                                        stream);
      case DType::kFloat16:
        return rope_and_cache_typed<__half, __half>(p, is_neox, to_fp8, stream);
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace gpu
}  // namespace pagoda
