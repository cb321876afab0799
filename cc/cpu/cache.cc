// reshape_and_cache (see cc/cpu/kernels.h): writes the new tokens' keys and
// values into the paged KV cache. A cache slot holds one token's row of
// num_kv_heads * head_size elements, so each token is two row copies (no
// arithmetic, hence no dtype-specific code beyond the element size).
#include "cc/cpu/kernels.h"
#include "cc/cpu/vec.h"

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {

void reshape_and_cache(const void* key, int64_t key_stride, const void* value,
                       int64_t value_stride, void* key_cache,
                       void* value_cache, const int64_t* slot_mapping,
                       int64_t num_tokens, int64_t row_width, DType dtype) {
  if (num_tokens <= 0 || row_width <= 0) return;
  const int64_t elem = dtype == DType::kFloat32 ? 4 : 2;
  const int64_t row_bytes = row_width * elem;
  const char* k = static_cast<const char*>(key);
  const char* v = static_cast<const char*>(value);
  char* kc = static_cast<char*>(key_cache);
  char* vc = static_cast<char*>(value_cache);
  // A copy is cheap per element: only large batches (prefill) go parallel.
  vec::parallel_for_rows(num_tokens, row_width / 4, [&](int64_t t) {
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
