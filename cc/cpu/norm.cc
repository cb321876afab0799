// RMSNorm kernels (see cc/cpu/kernels.h), following Hugging Face LlamaRMSNorm:
//   h = x.float(); h = h * rsqrt(mean(h^2) + eps); out = weight * h.to(dtype)
// i.e. the normalized value is rounded to the input dtype before it is
// multiplied by the weight (in fp32) and rounded again. rsqrt is 1/sqrtf.
#include "cc/cpu/kernels.h"
#include "cc/cpu/vec.h"

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace {

using namespace vec;  // NOLINT

constexpr int L = kLanes;

// sum(x[i]^2) over one row, in fp32.
template <DType D>
inline float sum_squares(const storage_t<D>* x, int64_t n) {
  Vec a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
  int64_t i = 0;
  for (; i + 4 * L <= n; i += 4 * L) {
    const Vec v0 = load<D>(x + i);
    const Vec v1 = load<D>(x + i + L);
    const Vec v2 = load<D>(x + i + 2 * L);
    const Vec v3 = load<D>(x + i + 3 * L);
    a0 = fmadd(v0, v0, a0);
    a1 = fmadd(v1, v1, a1);
    a2 = fmadd(v2, v2, a2);
    a3 = fmadd(v3, v3, a3);
  }
  for (; i + L <= n; i += L) {
    const Vec v = load<D>(x + i);
    a0 = fmadd(v, v, a0);
  }
  if (i < n) {
    const Vec v = load_partial<D>(x + i, static_cast<int>(n - i));
    a1 = fmadd(v, v, a1);
  }
  return hsum((a0 + a1) + (a2 + a3));
}

inline float inv_rms(float sum_sq, int64_t n, float eps) {
  const float var = sum_sq / static_cast<float>(n);
  return 1.0f / __builtin_sqrtf(var + eps);
}

// out[i] = round(w[i] * round(x[i] * inv)). out may equal x.
template <DType D>
inline void scale_row(storage_t<D>* out, const storage_t<D>* x,
                      const storage_t<D>* w, int64_t n, float inv) {
  const Vec vinv = set1(inv);
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    const Vec h0 = round_to<D>(load<D>(x + i) * vinv);
    const Vec h1 = round_to<D>(load<D>(x + i + L) * vinv);
    store<D>(out + i, load<D>(w + i) * h0);
    store<D>(out + i + L, load<D>(w + i + L) * h1);
  }
  for (; i + L <= n; i += L) {
    const Vec h = round_to<D>(load<D>(x + i) * vinv);
    store<D>(out + i, load<D>(w + i) * h);
  }
  if (i < n) {
    const int r = static_cast<int>(n - i);
    const Vec h = round_to<D>(load_partial<D>(x + i, r) * vinv);
    store_partial<D>(out + i, load_partial<D>(w + i, r) * h, r);
  }
}

template <DType D>
void rms_norm_impl(void* out, int64_t out_stride, const void* x,
                   int64_t x_stride, const void* weight, int64_t num_tokens,
                   int64_t hidden, float eps) {
  using T = storage_t<D>;
  T* o = static_cast<T*>(out);
  const T* in = static_cast<const T*>(x);
  const T* w = static_cast<const T*>(weight);
  parallel_for_rows(num_tokens, hidden, [&](int64_t t) {
    const T* xr = in + t * x_stride;
    const float inv = inv_rms(sum_squares<D>(xr, hidden), hidden, eps);
    scale_row<D>(o + t * out_stride, xr, w, hidden, inv);
  });
}

template <DType D>
void fused_add_rms_norm_impl(void* x, int64_t x_stride, void* residual,
                             int64_t residual_stride, const void* weight,
                             int64_t num_tokens, int64_t hidden, float eps) {
  using T = storage_t<D>;
  T* xs = static_cast<T*>(x);
  T* rs = static_cast<T*>(residual);
  const T* w = static_cast<const T*>(weight);
  parallel_for_rows(num_tokens, hidden, [&](int64_t t) {
    T* xr = xs + t * x_stride;
    T* rr = rs + t * residual_stride;
    // Pass 1: residual = round(x + residual); sum of squares of the rounded
    // residual.
    Vec a0 = zero(), a1 = zero();
    int64_t i = 0;
    for (; i + 2 * L <= hidden; i += 2 * L) {
      const Vec s0 = round_to<D>(load<D>(xr + i) + load<D>(rr + i));
      const Vec s1 = round_to<D>(load<D>(xr + i + L) + load<D>(rr + i + L));
      store<D>(rr + i, s0);
      store<D>(rr + i + L, s1);
      a0 = fmadd(s0, s0, a0);
      a1 = fmadd(s1, s1, a1);
    }
    for (; i + L <= hidden; i += L) {
      const Vec s = round_to<D>(load<D>(xr + i) + load<D>(rr + i));
      store<D>(rr + i, s);
      a0 = fmadd(s, s, a0);
    }
    if (i < hidden) {
      const int r = static_cast<int>(hidden - i);
      const Vec s =
          round_to<D>(load_partial<D>(xr + i, r) + load_partial<D>(rr + i, r));
      store_partial<D>(rr + i, s, r);
      a1 = fmadd(s, s, a1);
    }
    const float inv = inv_rms(hsum(a0 + a1), hidden, eps);
    // Pass 2: x = rms_norm(residual).
    scale_row<D>(xr, rr, w, hidden, inv);
  });
}

}  // namespace

void rms_norm(void* out, int64_t out_stride, const void* x, int64_t x_stride,
              const void* weight, int64_t num_tokens, int64_t hidden,
              float eps, DType dtype) {
  if (num_tokens <= 0 || hidden <= 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return rms_norm_impl<DType::kFloat32>(out, out_stride, x, x_stride,
                                            weight, num_tokens, hidden, eps);
    case DType::kBFloat16:
      return rms_norm_impl<DType::kBFloat16>(out, out_stride, x, x_stride,
                                             weight, num_tokens, hidden, eps);
    case DType::kFloat16:
      return rms_norm_impl<DType::kFloat16>(out, out_stride, x, x_stride,
                                            weight, num_tokens, hidden, eps);
  }
}

void fused_add_rms_norm(void* x, int64_t x_stride, void* residual,
                        int64_t residual_stride, const void* weight,
                        int64_t num_tokens, int64_t hidden, float eps,
                        DType dtype) {
  if (num_tokens <= 0 || hidden <= 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return fused_add_rms_norm_impl<DType::kFloat32>(
          x, x_stride, residual, residual_stride, weight, num_tokens, hidden,
          eps);
    case DType::kBFloat16:
      return fused_add_rms_norm_impl<DType::kBFloat16>(
          x, x_stride, residual, residual_stride, weight, num_tokens, hidden,
          eps);
    case DType::kFloat16:
      return fused_add_rms_norm_impl<DType::kFloat16>(
          x, x_stride, residual, residual_stride, weight, num_tokens, hidden,
          eps);
  }
}

}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
