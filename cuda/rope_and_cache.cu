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

// The cache's element for a value of T already rounded to T.
template <typename T, bool kFp8>
struct CacheElem;
template <typename T>
struct CacheElem<T, false> {
  using type = T;
  __device__ __forceinline__ static T from(float f) { return from_float<T>(f); }
};
#if !PAGODA_HIP
template <typename T>
struct CacheElem<T, true> {
  using type = uint8_t;
  __device__ __forceinline__ static uint8_t from(float f) {
    return static_cast<uint8_t>(
        __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
  }
};
#endif

template <typename T, typename C, bool kNeox, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    rope_and_cache_kernel(const RopeAndCacheParams p) {
  using Cache = CacheElem<T, kFp8>;
  using E = typename Cache::type;
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
      for (int i = lane; i < head_size; i += PAGODA_WARP_SIZE) {
        vc[i] = Cache::from(to_float(v[i]));
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
    for (int i = lane; i < head_size; i += PAGODA_WARP_SIZE) {
      const float f = to_float(x[i]);
      buf[i] = f;
      ss += f * f;
    }
    if (w != nullptr) {
      const float inv =
          1.0f / sqrtf(warp_reduce_sum(ss) / static_cast<float>(head_size) +
                       p.eps);
      for (int i = lane; i < head_size; i += PAGODA_WARP_SIZE) {
        buf[i] = round_to<T>(to_float(w[i]) * round_to<T>(buf[i] * inv));
      }
    }
    warp_sync();
    const C* cos_ptr = static_cast<const C*>(p.cos_sin_cache) +
                       p.positions[t] * p.rot_dim;
    const C* sin_ptr = cos_ptr + embed;
    E* kc = is_q || !cached ? nullptr
                            : static_cast<E*>(p.key_cache) + slot * row_width +
                                  static_cast<int64_t>(head) * head_size;
    for (int i = lane; i < head_size; i += PAGODA_WARP_SIZE) {
      float y = buf[i];
      if (i < 2 * embed) {
        // The pair (x1, x2) this element belongs to, and which of the two it is.
        const int pair = kNeox ? (i < embed ? i : i - embed) : i / 2;
        const bool first = kNeox ? i < embed : (i & 1) == 0;
        const int i1 = kNeox ? pair : 2 * pair;
        const int i2 = kNeox ? pair + embed : 2 * pair + 1;
        const float x1 = buf[i1], x2 = buf[i2];
        const float c = to_float(cos_ptr[pair]), s = to_float(sin_ptr[pair]);
        y = first ? fmaf(x1, c, -__fmul_rn(x2, s)) : fmaf(x2, c, __fmul_rn(x1, s));
      }
      const T out = from_float<T>(y);
      x[i] = out;
      if (kc != nullptr) kc[i] = Cache::from(to_float(out));
    }
    // The next job reuses buf: every lane must be done reading it.
    warp_sync();
  }
}

template <typename T, typename C, bool kNeox, bool kFp8>
void launch(const RopeAndCacheParams& p, cudaStream_t stream) {
  const int64_t jobs = p.num_tokens * (p.num_heads + 2 * p.num_kv_heads);
  // Warps per block on the smallest warp size: enough shared memory for every
  // warp whatever the device's warp size is.
  int64_t blocks = (jobs + kMaxWarpsPerBlock - 1) / kMaxWarpsPerBlock;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  const size_t smem = sizeof(float) * kMaxWarpsPerBlock * p.head_size;
  rope_and_cache_kernel<T, C, kNeox, kFp8>
      <<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
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
      is_neox ? launch<T, C, true, true>(p, stream)
              : launch<T, C, false, true>(p, stream);
    }
#endif
  } else {
    is_neox ? launch<T, C, true, false>(p, stream)
            : launch<T, C, false, false>(p, stream);
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
