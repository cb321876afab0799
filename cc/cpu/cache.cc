// reshape_and_cache (see cc/cpu/kernels.h): writes the new tokens' keys and
// values into the paged KV cache. A cache slot holds one token's row of
// num_kv_heads * head_size elements, so each token is two row copies: plain
// copies where the cache has the K/V dtype, or fp32 rows rounded to bf16 (a
// 16-bit cache under an fp32 model; round to nearest even as torch's
// .to(torch.bfloat16)).
#include "cc/cpu/kernels.h"
#include "cc/cpu/vec.h"

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace {

using namespace vec;  // NOLINT

// dst[0..n) = src[0..n) rounded from S to D.
template <DType S, DType D>
inline void convert_row(storage_t<D>* dst, const storage_t<S>* src,
                        int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<D>(dst + i, load<S>(src + i));
  if (i < n) {
    const int r = static_cast<int>(n - i);
    store_partial<D>(dst + i, load_partial<S>(src + i, r), r);
  }
}

}  // namespace

void reshape_and_cache(const void* key, int64_t key_stride, const void* value,
                       int64_t value_stride, void* key_cache,
                       void* value_cache, const int64_t* slot_mapping,
                       int64_t num_tokens, int64_t row_width, DType dtype,
                       DType cache_dtype) {
  if (num_tokens <= 0 || row_width <= 0) return;
  if (cache_dtype != dtype) {  // fp32 K/V into a bf16 cache
    using S = storage_t<DType::kFloat32>;
    using D = storage_t<DType::kBFloat16>;
    const S* k = static_cast<const S*>(key);
    const S* v = static_cast<const S*>(value);
    D* kc = static_cast<D*>(key_cache);
    D* vc = static_cast<D*>(value_cache);
    parallel_for_rows(num_tokens, row_width, [&](int64_t t) {
      const int64_t slot = slot_mapping[t];
      if (slot < 0) return;  // padding token
      convert_row<DType::kFloat32, DType::kBFloat16>(
          kc + slot * row_width, k + t * key_stride, row_width);
      convert_row<DType::kFloat32, DType::kBFloat16>(
          vc + slot * row_width, v + t * value_stride, row_width);
    });
    return;
  }
  const int64_t elem = dtype == DType::kFloat32 ? 4 : 2;
  const int64_t row_bytes = row_width * elem;
  const char* k = static_cast<const char*>(key);
  const char* v = static_cast<const char*>(value);
  char* kc = static_cast<char*>(key_cache);
  char* vc = static_cast<char*>(value_cache);
  // A copy is cheap per element: only large batches (prefill) go parallel.
  parallel_for_rows(num_tokens, row_width / 4, [&](int64_t t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) return;  // padding token
    __builtin_memcpy(kc + slot * row_bytes, k + t * key_stride * elem,
                     static_cast<unsigned long>(row_bytes));
    __builtin_memcpy(vc + slot * row_bytes, v + t * value_stride * elem,
                     static_cast<unsigned long>(row_bytes));
  });
}

}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
