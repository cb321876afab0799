// GPU sampling: one token id per row of logits [num_rows, vocab], with the
// semantics of Sampler._sample (model_executor/layers/sampler.py):
// temperature 0 is greedy (argmax: lowest index among ties, NaN counts as the
// largest, as torch.argmax); otherwise l = logits / temperature, then min_p
// (drop tokens whose probability is below min_p x the top one), top_k (keep the
// k largest, ties with the k-th too), top_p (keep the smallest set of most
// likely tokens whose probability reaches p; ties with its least likely token
// too), then an exponential race among the kept tokens.
//
// No sort. One block per row; every filter keeps the tokens whose value is at
// or above a threshold, and each threshold is found by radix select over an
// order-preserving 32-bit key of l: digits of 11, 11 and 10 bits, one histogram
// pass over the row per digit (a 152k-token fp32 row is 600 KB: the passes
// after the first read it from L2). top_k selects by token count, top_p by
// probability mass, summed as integers (2^-40 fixed point relative to the top
// token) so that the sums, and the threshold, do not depend on the order of
// the atomic adds. Passes over the row: 1 for temperature alone (the race
// needs no max), +1 for the row max when min_p or top_p is on, +3 for top_k,
// +3 for top_p.
//
// The race: argmax over kept tokens of l_i - log(E_i), E_i ~ Exp(1), picks
// token i with probability softmax(l)_i over the kept set (the Gumbel-max form
// of argmax p_i / E_i). E_i = -log1p(-u), u = (r + 0.5) / 2^32 with r the
// (i % 4)-th output of Philox4x32-10 keyed by seeds[row] with counter
// (i / 4, offsets[row]): a row's draw depends only on its seed, its offset and
// the token id, never on the batch around it (ops.sample_reference computes
// the same stream in torch).

#include <climits>
#include <cmath>
#include <cstdint>

#include "cuda/kernels.h"

namespace pagoda {
namespace gpu {
namespace {

using u64 = unsigned long long;  // atomicAdd's 64-bit type on CUDA and HIP

constexpr int kThreads = 1024;
constexpr int kMaxWarps = kThreads / 32;
constexpr int kBins = 2048;  // 2^11: the widest digit
static_assert(kBins == 2 * kThreads, "the scan gives each thread two bins");
constexpr int kLevels = 3;
constexpr float kMassScale = 1099511627776.0f;  // 2^40

// Philox4x32-10 constants (Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC 2011).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

struct Scratch {
  u64 hist[kBins];
  u64 warp_sums[kMaxWarps];
  u64 total;
  u64 above;
  uint32_t digit;
  float warp_values[kMaxWarps];
  int warp_indices[kMaxWarps];
  float value;
  int index;
};

__device__ __forceinline__ int digit_shift(int level) {
  return level == 0 ? 21 : level == 1 ? 10 : 0;
}
__device__ __forceinline__ int digit_bits(int level) {
  return level == 2 ? 10 : 11;
}

// Unsigned key in the order of the floats (-0 and +0 share one key, as they
// compare equal).
__device__ __forceinline__ uint32_t order_key(float f) {
  if (f == 0.0f) f = 0.0f;
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint4 philox4x32_10(uint32_t c0, uint32_t c1,
                                               uint32_t c2, uint32_t c3,
                                               uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(kPhiloxM0, c0), lo0 = kPhiloxM0 * c0;
    const uint32_t hi1 = __umulhi(kPhiloxM1, c2), lo1 = kPhiloxM1 * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return make_uint4(c0, c1, c2, c3);
}

// The four random words of tokens 4 * group .. 4 * group + 3.
__device__ __forceinline__ uint4 token_randoms(int group, u64 offset,
                                               u64 seed) {
  return philox4x32_10(static_cast<uint32_t>(group), 0u,
                       static_cast<uint32_t>(offset),
                       static_cast<uint32_t>(offset >> 32),
                       static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

__device__ __forceinline__ uint32_t word(const uint4& r, int j) {
  return j == 0 ? r.x : j == 1 ? r.y : j == 2 ? r.z : r.w;
}

// -log(E), E ~ Exp(1) from a random word. u is in (0, 1] (r near 2^32 rounds
// to 1, giving E = inf: that token cannot win, as with any huge E); log1p keeps
// the small E that decide the race exact.
__device__ __forceinline__ float gumbel(uint32_t r) {
  const float u = (static_cast<float>(r) + 0.5f) * 2.3283064365386963e-10f;
  return -logf(-log1pf(-u));
}

// (value, index) maxima: NaN counts as the largest value (torch.argmax),
// ties go to the lower index; index INT_MAX is "none yet".
__device__ __forceinline__ bool better(float av, int ai, float bv, int bi) {
  const bool a_nan = av != av, b_nan = bv != bv;
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && av != bv) return av > bv;
  return ai < bi;
}

__device__ __forceinline__ u64 shfl_xor_u64(u64 v, int lane_mask) {
  const uint32_t lo = __float_as_uint(
      warp_shfl_xor(__uint_as_float(static_cast<uint32_t>(v)), lane_mask));
  const uint32_t hi = __float_as_uint(warp_shfl_xor(
      __uint_as_float(static_cast<uint32_t>(v >> 32)), lane_mask));
  return (static_cast<u64>(hi) << 32) | lo;
}

// Inclusive prefix sum of v over the warp's lanes (butterfly: after step m,
// `group` is the sum over the aligned 2m-lane group holding this lane).
__device__ __forceinline__ u64 warp_inclusive_scan(u64 v, u64* warp_total) {
  const int lane = threadIdx.x % PAGODA_WARP_SIZE;
  u64 inclusive = v, group = v;
#pragma unroll
  for (int m = 1; m < PAGODA_WARP_SIZE; m <<= 1) {
    const u64 other = shfl_xor_u64(group, m);
    if (lane & m) inclusive += other;
    group += other;
  }
  *warp_total = group;
  return inclusive;
}

// Inclusive prefix sum of v over the block's threads in thread order; s.total
// gets the block's sum. Every thread of the block must call it.
__device__ u64 block_inclusive_scan(u64 v, Scratch& s) {
  const int lane = threadIdx.x % PAGODA_WARP_SIZE;
  const int warp = threadIdx.x / PAGODA_WARP_SIZE;
  constexpr int kWarps = kThreads / PAGODA_WARP_SIZE;
  u64 warp_total;
  const u64 inclusive = warp_inclusive_scan(v, &warp_total);
  if (lane == 0) s.warp_sums[warp] = warp_total;
  __syncthreads();
  if (warp == 0) {
    const u64 w = lane < kWarps ? s.warp_sums[lane] : 0;
    u64 total;
    const u64 w_inclusive = warp_inclusive_scan(w, &total);
    if (lane < kWarps) s.warp_sums[lane] = w_inclusive - w;  // exclusive
    if (lane == 0) s.total = total;
  }
  __syncthreads();
  return inclusive + s.warp_sums[warp];
}

__device__ float block_max(float v, Scratch& s) {
  const int lane = threadIdx.x % PAGODA_WARP_SIZE;
  const int warp = threadIdx.x / PAGODA_WARP_SIZE;
  constexpr int kWarps = kThreads / PAGODA_WARP_SIZE;
#pragma unroll
  for (int m = PAGODA_WARP_SIZE / 2; m > 0; m >>= 1) {
    v = fmaxf(v, warp_shfl_xor(v, m));
  }
  if (lane == 0) s.warp_values[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? s.warp_values[lane] : -INFINITY;
#pragma unroll
    for (int m = PAGODA_WARP_SIZE / 2; m > 0; m >>= 1) {
      v = fmaxf(v, warp_shfl_xor(v, m));
    }
    if (lane == 0) s.value = v;
  }
  __syncthreads();
  return s.value;
}

__device__ int block_argmax(float v, int i, Scratch& s) {
  const int lane = threadIdx.x % PAGODA_WARP_SIZE;
  const int warp = threadIdx.x / PAGODA_WARP_SIZE;
  constexpr int kWarps = kThreads / PAGODA_WARP_SIZE;
  auto reduce = [&]() {
#pragma unroll
    for (int m = PAGODA_WARP_SIZE / 2; m > 0; m >>= 1) {
      const float ov = warp_shfl_xor(v, m);
      const int oi = __float_as_int(warp_shfl_xor(__int_as_float(i), m));
      if (better(ov, oi, v, i)) {
        v = ov;
        i = oi;
      }
    }
  };
  reduce();
  if (lane == 0) {
    s.warp_values[warp] = v;
    s.warp_indices[warp] = i;
  }
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? s.warp_values[lane] : -INFINITY;
    i = lane < kWarps ? s.warp_indices[lane] : INT_MAX;
    reduce();
    if (lane == 0) s.index = i;
  }
  __syncthreads();
  return s.index;
}

// f(i, value as float) for every element of the row, each by one thread; V
// elements a 16-byte access where V > 1 (the host checked the alignment).
template <typename T, int V, typename F>
__device__ __forceinline__ void for_each(const T* x, int n, F&& f) {
  const int n_vec = n / V;
  for (int v = threadIdx.x; v < n_vec; v += kThreads) {
    const Vec<T, V> a = load_vec<T, V>(x + static_cast<int64_t>(v) * V);
#pragma unroll
    for (int j = 0; j < V; ++j) f(v * V + j, a.get(j));
  }
  if constexpr (V > 1) {  // the last n % V elements
    for (int i = n_vec * V + threadIdx.x; i < n; i += kThreads) {
      f(i, to_float(x[i]));
    }
  }
}

// The largest key t such that the candidates with key >= t weigh at least
// `target` (if `relative`, target x the candidates' total weight; at least 1,
// so the heaviest candidate is always kept): keeping key >= t keeps exactly
// the most likely candidates that reach the target, ties included. Returns
// `fallback` when all candidates together weigh less than the target.
// weigh(value, &key) sets the element's key and returns its integer weight
// (0: not a candidate). Every thread of the block must call it.
template <typename T, int V, typename Weigh>
__device__ __forceinline__ uint32_t radix_select(const T* x, int n, Scratch& s,
                                                 double target, bool relative,
                                                 uint32_t fallback,
                                                 Weigh&& weigh) {
  uint32_t prefix = 0;  // the digits chosen so far
  u64 above = 0;        // weight of candidates with a larger prefix
  for (int level = 0; level < kLevels; ++level) {
    const int shift = digit_shift(level), bits = digit_bits(level);
    for (int b = threadIdx.x; b < kBins; b += kThreads) s.hist[b] = 0;
    __syncthreads();
    for_each<T, V>(x, n, [&](int, float value) {
      uint32_t key;
      const u64 w = weigh(value, &key);
      if (w != 0 && (level == 0 || (key >> (shift + bits)) == prefix)) {
        atomicAdd(&s.hist[(key >> shift) & ((1u << bits) - 1u)], w);
      }
    });
    __syncthreads();
    // Thread t holds digits kBins-1-2t and kBins-2-2t: thread order is
    // descending digit order, so the scan sums the weight from the top.
    const int high_digit = kBins - 1 - 2 * static_cast<int>(threadIdx.x);
    const u64 high = s.hist[high_digit], low = s.hist[high_digit - 1];
    const u64 inclusive = block_inclusive_scan(high + low, s);
    const u64 exclusive = inclusive - (high + low);
    if (level == 0) {
      if (relative) target *= static_cast<double>(s.total);
      target = fmax(target, 1.0);
      if (static_cast<double>(s.total) < target) return fallback;
    }
    // Exactly one thread holds the digit where the running weight reaches
    // the target.
    if (static_cast<double>(above + exclusive) < target &&
        static_cast<double>(above + inclusive) >= target) {
      const bool in_high =
          static_cast<double>(above + exclusive + high) >= target;
      s.digit = static_cast<uint32_t>(in_high ? high_digit : high_digit - 1);
      s.above = above + exclusive + (in_high ? 0 : high);
    }
    __syncthreads();
    prefix = (prefix << bits) | s.digit;
    above = s.above;
  }
  return prefix;
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    sample_kernel(int64_t* __restrict__ out_ids, const T* __restrict__ logits,
                  int64_t logits_stride, int n,
                  const float* __restrict__ temperature,
                  const int64_t* __restrict__ top_k,
                  const float* __restrict__ top_p,
                  const float* __restrict__ min_p,
                  const int64_t* __restrict__ seeds,
                  const int64_t* __restrict__ offsets) {
  __shared__ Scratch s;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * logits_stride;
  const float temp = temperature[row];

  if (temp == 0.0f) {
    float best = -INFINITY;
    int best_i = INT_MAX;
    for_each<T, V>(x, n, [&](int i, float value) {
      if (better(value, i, best, best_i)) {
        best = value;
        best_i = i;
      }
    });
    const int token = block_argmax(best, best_i, s);
    if (threadIdx.x == 0) out_ids[row] = token;
    return;
  }

  const float mp = min_p != nullptr ? min_p[row] : 0.0f;
  const int64_t k = top_k != nullptr ? top_k[row] : 0;
  const float p = top_p != nullptr ? top_p[row] : 1.0f;
  float max_l = 0.0f;  // the largest l: min_p and top_p are relative to it
  if (mp > 0.0f || p < 1.0f) {
    float local = -INFINITY;
    for_each<T, V>(x, n, [&](int, float value) {
      local = fmaxf(local, value / temp);
    });
    max_l = block_max(local, s);
  }
  // min_p as torch computes it: softmax(l)_i < min_p * max softmax(l).
  auto min_p_drops = [&](float l) {
    return mp > 0.0f && expf(l - max_l) < mp;
  };

  uint32_t lo = 0;  // kept: order_key(l) >= lo (and not dropped by min_p)
  if (k > 0 && k < n) {
    lo = radix_select<T, V>(
        x, n, s, static_cast<double>(k), false, lo,
        [&](float value, uint32_t* key) -> u64 {
          const float l = value / temp;
          *key = order_key(l);
          return min_p_drops(l) ? 0 : 1;
        });
  }
  if (p < 1.0f) {
    const uint32_t lo_k = lo;
    lo = radix_select<T, V>(
        x, n, s, static_cast<double>(p), true, lo,
        [&](float value, uint32_t* key) -> u64 {
          const float l = value / temp;
          *key = order_key(l);
          if (*key < lo_k) return 0;
          const float e = expf(l - max_l);  // in [0, 1]
          if (!(e > 0.0f) || (mp > 0.0f && e < mp)) return 0;
          return __float2ull_rn(e * kMassScale);
        });
  }

  const u64 seed = static_cast<u64>(seeds[row]);
  const u64 offset = static_cast<u64>(offsets[row]);
  float best = -INFINITY;
  int best_i = INT_MAX;
  auto race = [&](int i, float value, uint32_t r) {
    const float l = value / temp;
    if (order_key(l) < lo || min_p_drops(l)) return;
    const float score = l + gumbel(r);
    if (better(score, i, best, best_i)) {
      best = score;
      best_i = i;
    }
  };
  const int n_vec = n / V;
  for (int v = threadIdx.x; v < n_vec; v += kThreads) {
    const Vec<T, V> a = load_vec<T, V>(x + static_cast<int64_t>(v) * V);
    if constexpr (V % 4 == 0) {  // one Philox call per four tokens
#pragma unroll
      for (int j = 0; j < V; j += 4) {
        const int i = v * V + j;
        const uint4 r = token_randoms(i >> 2, offset, seed);
        race(i, a.get(j), r.x);
        race(i + 1, a.get(j + 1), r.y);
        race(i + 2, a.get(j + 2), r.z);
        race(i + 3, a.get(j + 3), r.w);
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int i = v * V + j;
        race(i, a.get(j), word(token_randoms(i >> 2, offset, seed), i & 3));
      }
    }
  }
  if constexpr (V > 1) {
    for (int i = n_vec * V + threadIdx.x; i < n; i += kThreads) {
      race(i, to_float(x[i]), word(token_randoms(i >> 2, offset, seed), i & 3));
    }
  }
  const int token = block_argmax(best, best_i, s);
  // No kept token only if every l is NaN or the metadata is out of range.
  if (threadIdx.x == 0) out_ids[row] = token == INT_MAX ? 0 : token;
}

template <typename T>
cudaError_t sample_typed(int64_t* out_ids, const void* logits,
                         int64_t logits_stride, int64_t num_rows,
                         int64_t vocab_size, const float* temperature,
                         const int64_t* top_k, const float* top_p,
                         const float* min_p, const int64_t* seeds,
                         const int64_t* offsets, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* x = static_cast<const T*>(logits);
  const int n = static_cast<int>(vocab_size);
  const int grid = static_cast<int>(num_rows);
  if (is_aligned(logits, 16) && (num_rows == 1 || logits_stride % kVec == 0)) {
    sample_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(
        out_ids, x, logits_stride, n, temperature, top_k, top_p, min_p, seeds,
        offsets);
  } else {
    sample_kernel<T, 1><<<grid, kThreads, 0, stream>>>(
        out_ids, x, logits_stride, n, temperature, top_k, top_p, min_p, seeds,
        offsets);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t sample(int64_t* out_ids, const void* logits, int64_t logits_stride,
                   int64_t num_rows, int64_t vocab_size, DType dtype,
                   const float* temperature, const int64_t* top_k,
                   const float* top_p, const float* min_p,
                   const int64_t* seeds, const int64_t* offsets,
                   cudaStream_t stream) {
  if (num_rows < 0 || num_rows > INT_MAX || vocab_size < 1 ||
      vocab_size > kSampleMaxVocab) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return sample_typed<float>(out_ids, logits, logits_stride, num_rows,
                                 vocab_size, temperature, top_k, top_p, min_p,
                                 seeds, offsets, stream);
    case DType::kBFloat16:
      return sample_typed<uint16_t>(out_ids, logits, logits_stride, num_rows,
                                    vocab_size, temperature, top_k, top_p,
                                    min_p, seeds, offsets, stream);
    case DType::kFloat16:
      return sample_typed<__half>(out_ids, logits, logits_stride, num_rows,
                                  vocab_size, temperature, top_k, top_p, min_p,
                                  seeds, offsets, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace gpu
}  // namespace pagoda
