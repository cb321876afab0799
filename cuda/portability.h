// Lets the same .cu sources build with nvcc (CUDA) and hipcc (ROCm/HIP, AMD
// platform), and lets plain host C++ (g++ with the CUDA or HIP include dir)
// include cuda/kernels.h.
//
// Host-visible part (every compiler): the runtime types and calls the launchers
// use, spelled the CUDA way (cudaStream_t, cudaError_t, cudaSuccess,
// cudaErrorInvalidValue, cudaGetLastError, cudaGetErrorString); under HIP they
// are macros onto the hip* names.
//
// Device part (only under nvcc or hipcc, i.e. __CUDACC__ or __HIP__):
//   PAGODA_WARP_SIZE                 32 on NVIDIA, the wavefront size on AMD
//                                    (64 on CDNA; 32 on RDNA wave32 builds)
//   PAGODA_MAX_WARP_SIZE             64: host code rounds block sizes to this
//   pagoda::gpu::warp_shfl_xor(v, m) __shfl_xor_sync / __shfl_xor
//   pagoda::gpu::warp_reduce_sum(v)  butterfly sum over a full warp
//   pagoda::gpu::warp_sync()         the lanes' shared-memory writes seen by
//                                    the whole warp (__syncwarp)
//   pagoda::gpu::bf16_to_float / float_to_bf16_rn: bf16 kept as raw uint16_t
//                                    bits, round-to-nearest-even, NaN stays NaN
//                                    (quieted, sign and top payload bits kept)
//   fp16 goes through __half / __half2float / __float2half_rn on both.
//   to_float / from_float<T> / round_to<T> for T in {float, __half, uint16_t}
//   Vec<T, N>, load_vec, store_vec: 2..16-byte (or multiples of 16) vector
//                                    accesses, elements packed in 32-bit words
//
// Host C++ for ROCm must say which HIP platform it is (hipcc does this itself):
// g++ -D__HIP_PLATFORM_AMD__ -I<rocm>/include. For CUDA: -I<cuda>/include.
#pragma once

#include <cstdint>
#include <type_traits>

#if !defined(__NVCC__) &&                                            \
    (defined(__HIP__) || defined(__HIPCC__) ||                       \
     defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__))
#define PAGODA_HIP 1
#else
#define PAGODA_HIP 0
#endif

#if PAGODA_HIP

#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

#ifndef cudaStream_t
#define cudaStream_t hipStream_t
#endif
#ifndef cudaError_t
#define cudaError_t hipError_t
#endif
#ifndef cudaSuccess
#define cudaSuccess hipSuccess
#endif
#ifndef cudaErrorInvalidValue
#define cudaErrorInvalidValue hipErrorInvalidValue
#endif
#ifndef cudaGetLastError
#define cudaGetLastError hipGetLastError
#endif
#ifndef cudaGetErrorString
#define cudaGetErrorString hipGetErrorString
#endif

#else  // CUDA

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#endif  // PAGODA_HIP

#define PAGODA_MAX_WARP_SIZE 64

#if defined(__CUDACC__) || defined(__HIP__)
#define PAGODA_DEVICE_COMPILER 1
#else
#define PAGODA_DEVICE_COMPILER 0
#endif

#if PAGODA_DEVICE_COMPILER

#if PAGODA_HIP
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define PAGODA_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define PAGODA_WARP_SIZE 64
#endif
#else
#define PAGODA_WARP_SIZE 32
#endif

namespace pagoda {
namespace gpu {

__device__ __forceinline__ float warp_shfl_xor(float v, int lane_mask) {
#if PAGODA_HIP
  return __shfl_xor(v, lane_mask, PAGODA_WARP_SIZE);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, PAGODA_WARP_SIZE);
#endif
}

// Sum over all lanes of a warp; every lane of the warp must be active. Every
// lane gets the total.
__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int m = PAGODA_WARP_SIZE / 2; m > 0; m >>= 1) v += warp_shfl_xor(v, m);
  return v;
}

__device__ __forceinline__ void warp_sync() {
#if PAGODA_HIP
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

// bf16 <-> fp32 on raw bits (the upper half of an IEEE binary32).
__device__ __forceinline__ float bf16_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ uint16_t float_to_bf16_rn(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    // NaN: keep sign and top payload bits, force quiet so it cannot round to
    // infinity.
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  // Round to nearest, ties to even (overflow correctly rounds to infinity).
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Storage types: float (fp32), __half (fp16), uint16_t (bf16 bits).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(uint16_t x) { return bf16_to_float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ uint16_t from_float<uint16_t>(float x) {
  return float_to_bf16_rn(x);
}

// Rounds an fp32 value to T's precision and back.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

}  // namespace gpu
}  // namespace pagoda

#endif  // PAGODA_DEVICE_COMPILER

namespace pagoda {
namespace gpu {

// N elements of T (float, __half or uint16_t bf16 bits) moved as one access of
// N * sizeof(T) bytes, aligned to min(16, N * sizeof(T)); vectors over 16
// bytes are moved as several 16-byte accesses. Host code must check that
// alignment (vec_align) before handing a pointer to load_vec / store_vec.
//
// The elements are kept as packed 32-bit words (two 16-bit elements a word) so
// that register use stays at 4 bytes per 4 bytes of data; get/set convert an
// element to/from fp32 (set rounds to T). A 2-byte vector (one 16-bit
// element) holds it in a uint16_t word.
template <typename T, int N>
struct alignas(N * sizeof(T) < 16 ? N * sizeof(T) : 16) Vec {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "2- or 4-byte elements");
  static constexpr int kBytes = static_cast<int>(N * sizeof(T));
  static constexpr int kWords = kBytes < 4 ? 1 : kBytes / 4;
  using Word = std::conditional_t<(kBytes < 4), uint16_t, uint32_t>;
  Word w[kWords];

#if PAGODA_DEVICE_COMPILER
  // j must be a compile-time constant after unrolling (register arrays).
  __device__ __forceinline__ float get(int j) const;
  __device__ __forceinline__ void set(int j, float f);
#endif
};

template <typename T, int N>
constexpr int vec_align() {
  return static_cast<int>(alignof(Vec<T, N>));
}

// Whether p is aligned to `bytes` (host code choosing a vector width).
inline bool is_aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

#if PAGODA_DEVICE_COMPILER
namespace detail {

// Raw bits of one element and back.
__device__ __forceinline__ uint32_t to_bits(float x) {
  return __float_as_uint(x);
}
__device__ __forceinline__ uint32_t to_bits(uint16_t x) { return x; }
__device__ __forceinline__ uint32_t to_bits(__half x) {
  return __half_as_ushort(x);
}

template <typename T>
__device__ __forceinline__ T from_bits(uint32_t b);
template <>
__device__ __forceinline__ float from_bits<float>(uint32_t b) {
  return __uint_as_float(b);
}
template <>
__device__ __forceinline__ uint16_t from_bits<uint16_t>(uint32_t b) {
  return static_cast<uint16_t>(b);
}
template <>
__device__ __forceinline__ __half from_bits<__half>(uint32_t b) {
  return __ushort_as_half(static_cast<unsigned short>(b));
}

}  // namespace detail

template <typename T, int N>
__device__ __forceinline__ float Vec<T, N>::get(int j) const {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w[j]);
  } else if constexpr (std::is_same_v<T, uint16_t>) {  // bf16
    const uint32_t word = w[j >> 1];
    return __uint_as_float((j & 1) ? (word & 0xffff0000u) : (word << 16));
  } else {  // fp16
    const uint32_t word = w[j >> 1];
    return __half2float(detail::from_bits<__half>(
        (j & 1) ? (word >> 16) : (word & 0xffffu)));
  }
}

template <typename T, int N>
__device__ __forceinline__ void Vec<T, N>::set(int j, float f) {
  const uint32_t b = detail::to_bits(from_float<T>(f));
  if constexpr (sizeof(T) == 4) {
    w[j] = b;
  } else if constexpr (kBytes == 2) {
    w[0] = static_cast<Word>(b);
  } else if (j & 1) {
    w[j >> 1] = (w[j >> 1] & 0x0000ffffu) | (b << 16);
  } else {
    w[j >> 1] = (w[j >> 1] & 0xffff0000u) | b;
  }
}

// Explicit vector load/store of Vec<T, N> at p (aligned as Vec<T, N>): one
// 2/4/8/16-byte access, or several 16-byte ones. Going through uint2/uint4
// keeps the access wide.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  using V = Vec<T, N>;
  V r;
  if constexpr (V::kBytes == 2) {
    r.w[0] = static_cast<uint16_t>(detail::to_bits(*p));
  } else if constexpr (V::kBytes == 4) {
    r.w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (V::kBytes == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    r.w[0] = u.x;
    r.w[1] = u.y;
  } else {
    static_assert(V::kBytes % 16 == 0, "unsupported vector size");
#pragma unroll
    for (int c = 0; c < V::kBytes / 16; ++c) {
      const uint4 u = reinterpret_cast<const uint4*>(p)[c];
      r.w[4 * c + 0] = u.x;
      r.w[4 * c + 1] = u.y;
      r.w[4 * c + 2] = u.z;
      r.w[4 * c + 3] = u.w;
    }
  }
  return r;
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  using V = Vec<T, N>;
  if constexpr (V::kBytes == 2) {
    *p = detail::from_bits<T>(v.w[0]);
  } else if constexpr (V::kBytes == 4) {
    *reinterpret_cast<uint32_t*>(p) = v.w[0];
  } else if constexpr (V::kBytes == 8) {
    uint2 u;
    u.x = v.w[0];
    u.y = v.w[1];
#if PAGODA_HIP
    *reinterpret_cast<uint2*>(p) = u;
#else
    __stwb(reinterpret_cast<uint2*>(p), u);
#endif
  } else {
    static_assert(V::kBytes % 16 == 0, "unsupported vector size");
#pragma unroll
    for (int c = 0; c < V::kBytes / 16; ++c) {
      uint4 u;
      u.x = v.w[4 * c + 0];
      u.y = v.w[4 * c + 1];
      u.z = v.w[4 * c + 2];
      u.w = v.w[4 * c + 3];
#if PAGODA_HIP
      reinterpret_cast<uint4*>(p)[c] = u;
#else
      // A plain uint4 assignment is a struct copy that NVVM may split into
      // four 32-bit stores inside nested loops; __stwb is st.global.wb.v4
      // (.wb is the default store cache policy).
      __stwb(reinterpret_cast<uint4*>(p) + c, u);
#endif
    }
  }
}
#endif  // PAGODA_DEVICE_COMPILER

}  // namespace gpu
}  // namespace pagoda
