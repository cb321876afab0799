// rotary_embedding (see cc/cpu/kernels.h). For each token, the cos/sin row
// positions[t] of cos_sin_cache is converted once to fp32 and reused by every
// query and key head of that token. Each output element is computed in fp32
// (x1*cos - x2*sin with one fused multiply-add) and rounded once to the dtype.
// Elements at and past rot_dim in a head are neither read nor written.
#include "cc/cpu/kernels.h"
#include "cc/cpu/vec.h"

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace {

using vec::fmadd;
using vec::fmaddsub;
using vec::fmsub;
using vec::kLanes;
using vec::load;
using vec::load_partial;
using vec::storage_t;
using vec::store;
using vec::store_partial;
using vec::swap_pairs;
using vec::to_float;
using vec::Vec;

constexpr int L = kLanes;
constexpr DType F32 = DType::kFloat32;

// rot_dim up to this many elements uses a stack table; larger ones the heap.
constexpr int64_t kStackRotDim = 1024;

// NeoX: pairs (i, i + half), cos/sin at c[i], s[i].
template <DType D>
inline void rotate_neox(storage_t<D>* v, const float* c, const float* s,
                        int64_t half) {
  int64_t i = 0;
  for (; i + L <= half; i += L) {
    const Vec x1 = load<D>(v + i);
    const Vec x2 = load<D>(v + half + i);
    const Vec cv = load<F32>(c + i);
    const Vec sv = load<F32>(s + i);
    store<D>(v + i, fmsub(x1, cv, x2 * sv));
    store<D>(v + half + i, fmadd(x2, cv, x1 * sv));
  }
  if (i < half) {
    const int r = static_cast<int>(half - i);
    const Vec x1 = load_partial<D>(v + i, r);
    const Vec x2 = load_partial<D>(v + half + i, r);
    const Vec cv = load_partial<F32>(c + i, r);
    const Vec sv = load_partial<F32>(s + i, r);
    store_partial<D>(v + i, fmsub(x1, cv, x2 * sv), r);
    store_partial<D>(v + half + i, fmadd(x2, cv, x1 * sv), r);
  }
}

// GPT-J: pairs (2i, 2i + 1); c and s hold each cos/sin value twice
// (c[2i] = c[2i + 1] = cos[i]). n = 2 * (rot_dim / 2) is even, and so is
// kLanes, so pairs never straddle a vector boundary.
template <DType D>
inline void rotate_gptj(storage_t<D>* v, const float* c, const float* s,
                        int64_t n) {
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const Vec x = load<D>(v + i);
    // even lanes: x[2i]*cos - x[2i+1]*sin; odd lanes: x[2i+1]*cos + x[2i]*sin
    store<D>(v + i, fmaddsub(x, load<F32>(c + i),
                             swap_pairs(x) * load<F32>(s + i)));
  }
  if (i < n) {
    const int r = static_cast<int>(n - i);
    const Vec x = load_partial<D>(v + i, r);
    store_partial<D>(v + i,
                     fmaddsub(x, load_partial<F32>(c + i, r),
                              swap_pairs(x) * load_partial<F32>(s + i, r)),
                     r);
  }
}

template <DType D, DType C>
void rotary_impl(const int64_t* positions, void* query, int64_t query_stride,
                 void* key, int64_t key_stride, int64_t num_tokens,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                 const void* cos_sin_cache, int64_t rot_dim, bool is_neox) {
  using T = storage_t<D>;
  using CT = storage_t<C>;
  T* q = static_cast<T*>(query);
  T* k = static_cast<T*>(key);
  const CT* cache = static_cast<const CT*>(cos_sin_cache);
  const int64_t half = rot_dim / 2;
  const int64_t heads = num_heads + (k != nullptr ? num_kv_heads : 0);

  vec::parallel_for_rows(num_tokens, heads * rot_dim, [&](int64_t t) {
    const CT* row = cache + positions[t] * rot_dim;
    alignas(64) float stack_table[2 * kStackRotDim];
    float* heap_table = nullptr;
    float* table = stack_table;
    if (rot_dim > kStackRotDim) table = heap_table = new float[2 * rot_dim];

    const float* c;
    const float* s;
    if (is_neox) {
      if constexpr (C == F32) {
        c = row;
        s = row + half;
      } else {
        float* tc = table;
        float* ts = table + half;
        for (int64_t i = 0; i < half; ++i) {
          tc[i] = to_float<C>(row[i]);
          ts[i] = to_float<C>(row[half + i]);
        }
        c = tc;
        s = ts;
      }
    } else {
      float* tc = table;
      float* ts = table + 2 * half;
      for (int64_t i = 0; i < half; ++i) {
        tc[2 * i] = tc[2 * i + 1] = to_float<C>(row[i]);
        ts[2 * i] = ts[2 * i + 1] = to_float<C>(row[half + i]);
      }
      c = tc;
      s = ts;
    }

    T* qrow = q + t * query_stride;
    T* krow = k != nullptr ? k + t * key_stride : nullptr;
    if (is_neox) {
      for (int64_t h = 0; h < num_heads; ++h)
        rotate_neox<D>(qrow + h * head_size, c, s, half);
      if (krow != nullptr)
        for (int64_t h = 0; h < num_kv_heads; ++h)
          rotate_neox<D>(krow + h * head_size, c, s, half);
    } else {
      for (int64_t h = 0; h < num_heads; ++h)
        rotate_gptj<D>(qrow + h * head_size, c, s, 2 * half);
      if (krow != nullptr)
        for (int64_t h = 0; h < num_kv_heads; ++h)
          rotate_gptj<D>(krow + h * head_size, c, s, 2 * half);
    }
    delete[] heap_table;
  });
}

template <DType D>
void rotary_dispatch_cache(const int64_t* positions, void* query,
                           int64_t query_stride, void* key, int64_t key_stride,
                           int64_t num_tokens, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_size,
                           const void* cos_sin_cache, int64_t rot_dim,
                           bool is_neox, DType cache_dtype) {
  switch (cache_dtype) {
    case DType::kFloat32:
      return rotary_impl<D, DType::kFloat32>(
          positions, query, query_stride, key, key_stride, num_tokens,
          num_heads, num_kv_heads, head_size, cos_sin_cache, rot_dim, is_neox);
    case DType::kBFloat16:
      return rotary_impl<D, DType::kBFloat16>(
          positions, query, query_stride, key, key_stride, num_tokens,
          num_heads, num_kv_heads, head_size, cos_sin_cache, rot_dim, is_neox);
    case DType::kFloat16:
      return rotary_impl<D, DType::kFloat16>(
          positions, query, query_stride, key, key_stride, num_tokens,
          num_heads, num_kv_heads, head_size, cos_sin_cache, rot_dim, is_neox);
  }
}

}  // namespace

void rotary_embedding(const int64_t* positions, void* query,
                      int64_t query_stride, void* key, int64_t key_stride,
                      int64_t num_tokens, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_size,
                      const void* cos_sin_cache, int64_t rot_dim, bool is_neox,
                      DType dtype, DType cache_dtype) {
  if (num_tokens <= 0 || rot_dim < 2) return;
  switch (dtype) {
    case DType::kFloat32:
      return rotary_dispatch_cache<DType::kFloat32>(
          positions, query, query_stride, key, key_stride, num_tokens,
          num_heads, num_kv_heads, head_size, cos_sin_cache, rot_dim, is_neox,
          cache_dtype);
    case DType::kBFloat16:
      return rotary_dispatch_cache<DType::kBFloat16>(
          positions, query, query_stride, key, key_stride, num_tokens,
          num_heads, num_kv_heads, head_size, cos_sin_cache, rot_dim, is_neox,
          cache_dtype);
    case DType::kFloat16:
      return rotary_dispatch_cache<DType::kFloat16>(
          positions, query, query_stride, key, key_stride, num_tokens,
          num_heads, num_kv_heads, head_size, cos_sin_cache, rot_dim, is_neox,
          cache_dtype);
  }
}

}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
