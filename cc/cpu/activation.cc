// silu_and_mul (see cc/cpu/kernels.h), following Hugging Face's
// act_fn(gate) * up on tensors of the input dtype:
//   s = silu(gate.float()) rounded to dtype; out = (s.float() * up.float())
//   rounded to dtype.
// silu(x) = x / (1 + exp(-x)), as PyTorch computes it.
#include "cc/cpu/kernels.h"
#include "cc/cpu/vec.h"

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace {

using vec::kLanes;
using vec::load;
using vec::load_partial;
using vec::round_to;
using vec::storage_t;
using vec::store;
using vec::store_partial;
using vec::Vec;

constexpr int L = kLanes;

template <DType D>
inline Vec silu_mul(Vec gate, Vec up) {
  return round_to<D>(vec::silu(gate)) * up;
}

template <DType D>
void silu_and_mul_impl(void* out, int64_t out_stride, const void* x,
                       int64_t x_stride, int64_t num_tokens, int64_t d) {
  using T = storage_t<D>;
  T* o = static_cast<T*>(out);
  const T* in = static_cast<const T*>(x);
  // exp makes a row cost a few times a plain elementwise pass.
  vec::parallel_for_rows(num_tokens, 4 * d, [&](int64_t t) {
    const T* gate = in + t * x_stride;
    const T* up = gate + d;
    T* orow = o + t * out_stride;
    int64_t i = 0;
    for (; i + 2 * L <= d; i += 2 * L) {
      const Vec r0 = silu_mul<D>(load<D>(gate + i), load<D>(up + i));
      const Vec r1 = silu_mul<D>(load<D>(gate + i + L), load<D>(up + i + L));
      store<D>(orow + i, r0);
      store<D>(orow + i + L, r1);
    }
    for (; i + L <= d; i += L) {
      store<D>(orow + i, silu_mul<D>(load<D>(gate + i), load<D>(up + i)));
    }
    if (i < d) {
      const int r = static_cast<int>(d - i);
      store_partial<D>(orow + i,
                       silu_mul<D>(load_partial<D>(gate + i, r),
                                   load_partial<D>(up + i, r)),
                       r);
    }
  });
}

}  // namespace

void silu_and_mul(void* out, int64_t out_stride, const void* x,
                  int64_t x_stride, int64_t num_tokens, int64_t d,
                  DType dtype) {
  if (num_tokens <= 0 || d <= 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return silu_and_mul_impl<DType::kFloat32>(out, out_stride, x, x_stride,
                                                num_tokens, d);
    case DType::kBFloat16:
      return silu_and_mul_impl<DType::kBFloat16>(out, out_stride, x, x_stride,
                                                 num_tokens, d);
    case DType::kFloat16:
      return silu_and_mul_impl<DType::kFloat16>(out, out_stride, x, x_stride,
                                                num_tokens, d);
  }
}

}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
