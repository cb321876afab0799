// gumbel_argmax (see cc/cpu/kernels.h): the exponential race of sampling on
// the CPU, with the noise stream of the GPU's pagoda::sample (cuda/sampling.cu,
// ops.sample_gumbel): token i of a row scores l_i - log(E_i), E_i =
// -log1p(-u), u = (w + 0.5) / 2^32, w the (i % 4)-th word of Philox4x32-10
// keyed by the row's seed at counter (i / 4, 0, offset low, offset high).
//
// Written as plain loops over kGroups counters at a time, which GCC turns
// into vector code for either build (32x32 -> 64-bit multiplies, the
// polynomial log below): torch's exponential_ drew the same number of values
// at about 20 ns each here, this at about 1.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "cc/cpu/kernels.h"

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace {

constexpr int kGroups = 16;                       // Philox counters per batch: 64 tokens
constexpr int64_t kChunk = 4096;  // tokens per work item (a multiple of 4 * kGroups)
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// c ? a : b on the bits: a plain conditional lets GCC move the computation
// of one side under a branch, and then the loop does not vectorize.
inline float pick(bool c, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return bits_float((float_bits(a) & mask) | (float_bits(b) & ~mask));
}

// Natural log of x > 0 (Cephes' logf polynomial on [sqrt(1/2), sqrt(2)),
// about 1 ulp); log(0) = -inf, log(inf) = inf. Branch-free, so that loops
// calling it vectorize.
inline float log_positive(float x) {
  const uint32_t bits = float_bits(x);
  int e = static_cast<int>(bits >> 23) - 127;
  float m = bits_float((bits & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  const bool high = m > 1.41421356f;
  m = pick(high, 0.5f * m, m);
  e += static_cast<int>(high);
  const float f = m - 1.0f, z = f * f, fe = static_cast<float>(e);
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y = y + fe * -2.12194440e-4f - 0.5f * z;
  const float r = f + y + fe * 0.693359375f;
  const float inf = std::numeric_limits<float>::infinity();
  return pick(x == 0.0f, -inf, pick(x == inf, inf, r));
}

// log1p(x) for x in [-1, 0]: log(1 + x) scaled by x / ((1 + x) - 1), which
// cancels the rounding of 1 + x (Goldberg's correction); x itself where 1 + x
// rounds to 1.
inline float log1p_nonpositive(float x) {
  const float y = 1.0f + x, d = y - 1.0f;
  return pick(d == 0.0f, x, log_positive(y) * (x / pick(d == 0.0f, 1.0f, d)));
}

// The race noise -log(E) of a random word.
inline float gumbel(uint32_t w) {
  // float(w), rounded once, from two exact halves (AVX2 has no unsigned
  // conversion, and GCC's emulation of one does not vectorize).
  const float w_float = static_cast<float>(static_cast<int32_t>(w >> 16)) * 65536.0f +
                        static_cast<float>(static_cast<int32_t>(w & 0xffffu));
  const float u = (w_float + 0.5f) * 2.3283064365386963e-10f;
  return -log_positive(-log1p_nonpositive(-u));
}

// (value, index) maxima as torch.argmax: NaN counts as the largest value,
// ties go to the lower index.
inline bool better(float av, int64_t ai, float bv, int64_t bi) {
  const bool a_nan = std::isnan(av), b_nan = std::isnan(bv);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && av != bv) return av > bv;
  return ai < bi;
}

// A lane's running maximum meets its tokens in increasing order: it takes a
// strictly greater score, or the first NaN (NaN wins, as in argmax), so ties
// keep the lower index.
inline void update(float& value, int64_t& index, float score, int64_t token) {
  const bool take = index < 0 || (!std::isnan(value) && (std::isnan(score) || score > value));
  value = take ? score : value;
  index = take ? token : index;
}

// The race noise of tokens t0 .. t0 + 4 * kGroups of a row keyed (k0, k1)
// at offset (o0, o1).
inline void race_noise(uint32_t k0, uint32_t k1, uint32_t o0, uint32_t o1, int64_t t0, float* noise) {
  uint32_t c0[kGroups], c1[kGroups], c2[kGroups], c3[kGroups];
  const uint32_t group0 = static_cast<uint32_t>(t0 / 4);
#pragma omp simd
  for (int g = 0; g < kGroups; ++g) {
    c0[g] = group0 + static_cast<uint32_t>(g);
    c1[g] = 0;
    c2[g] = o0;
    c3[g] = o1;
  }
  uint32_t key0 = k0, key1 = k1;
  for (int round = 0; round < 10; ++round) {
#pragma omp simd
    for (int g = 0; g < kGroups; ++g) {
      const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0[g];
      const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2[g];
      c0[g] = static_cast<uint32_t>(p1 >> 32) ^ c1[g] ^ key0;
      c1[g] = static_cast<uint32_t>(p1);
      c2[g] = static_cast<uint32_t>(p0 >> 32) ^ c3[g] ^ key1;
      c3[g] = static_cast<uint32_t>(p0);
    }
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  // Token t0 + 4g + w takes word w of counter g: the noise is computed
  // word by word (unit stride), then put in token order.
  const uint32_t* words[4] = {c0, c1, c2, c3};
  float by_word[4][kGroups];
  for (int w = 0; w < 4; ++w) {
#pragma omp simd
    for (int g = 0; g < kGroups; ++g) by_word[w][g] = gumbel(words[w][g]);
  }
  for (int g = 0; g < kGroups; ++g) {
    for (int w = 0; w < 4; ++w) noise[4 * g + w] = by_word[w][g];
  }
}

struct Best {
  float value;
  int64_t index;
};

// The best score among tokens [begin, end) of one row; begin is a multiple
// of 4 * kGroups. Without kNoise the scores are the logits themselves (greedy).
template <bool kNoise>
Best race_range(const float* logits, uint64_t seed, uint64_t offset, int64_t begin, int64_t end) {
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const uint32_t o0 = static_cast<uint32_t>(offset), o1 = static_cast<uint32_t>(offset >> 32);
  // Per lane (token slot j of a batch of 4 * kGroups): the best score seen
  // and its token.
  float lane_value[4 * kGroups];
  int64_t lane_index[4 * kGroups];
  for (int j = 0; j < 4 * kGroups; ++j) {
    lane_value[j] = -std::numeric_limits<float>::infinity();
    lane_index[j] = -1;
  }
  for (int64_t t0 = begin; t0 < end; t0 += 4 * kGroups) {
    float noise[4 * kGroups] = {};
    if constexpr (kNoise) race_noise(k0, k1, o0, o1, t0, noise);
    const float* l = logits + t0;
    if (end - t0 >= 4 * kGroups) {
#pragma omp simd
      for (int j = 0; j < 4 * kGroups; ++j) update(lane_value[j], lane_index[j], l[j] + noise[j], t0 + j);
    } else {
      for (int j = 0; j < end - t0; ++j) update(lane_value[j], lane_index[j], l[j] + noise[j], t0 + j);
    }
  }
  Best best{-std::numeric_limits<float>::infinity(), -1};
  for (int j = 0; j < 4 * kGroups; ++j) {
    if (lane_index[j] >= 0 && (best.index < 0 || better(lane_value[j], lane_index[j], best.value, best.index))) {
      best = {lane_value[j], lane_index[j]};
    }
  }
  return best;
}

}  // namespace

void gumbel_argmax(int64_t* out, const float* logits, int64_t logits_stride, const int64_t* seeds,
                   const int64_t* offsets, int64_t num_rows, int64_t vocab) {
  if (num_rows <= 0 || vocab <= 0) return;
  // Work items of kChunk tokens, so that one long row keeps both cores busy;
  // each row's items are combined in token order afterwards.
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  Best* partial = new Best[num_rows * chunks];
#pragma omp parallel for schedule(static) if (num_rows * vocab >= 2 * kChunk)
  for (int64_t item = 0; item < num_rows * chunks; ++item) {
    const int64_t row = item / chunks, begin = item % chunks * kChunk;
    const int64_t end = begin + kChunk < vocab ? begin + kChunk : vocab;
    const float* l = logits + row * logits_stride;
    partial[item] = seeds == nullptr ? race_range<false>(l, 0, 0, begin, end)
                                     : race_range<true>(l, static_cast<uint64_t>(seeds[row]),
                                                        static_cast<uint64_t>(offsets[row]), begin, end);
  }
  for (int64_t row = 0; row < num_rows; ++row) {
    Best best = partial[row * chunks];
    for (int64_t c = 1; c < chunks; ++c) {
      const Best& b = partial[row * chunks + c];
      if (better(b.value, b.index, best.value, best.index)) best = b;
    }
    out[row] = best.index;
  }
  delete[] partial;
}

}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
