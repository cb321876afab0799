// CUDA implementations of torch.ops.pagoda.* (schemas in cc/torch_ops.cc).
// Built into its own library (python/pagoda:_cuda_ops.so) that the Python
// package loads only beside a CUDA build of torch.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>

#include "cc/tensor_checks.h"
#include "cuda/kernels.h"

namespace pagoda {
namespace {

void check_launch(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, "pagoda::", op, " CUDA launch failed: ", cudaGetErrorString(status));
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor for this kernel, got ", t.device());
}

void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check_cuda(input, "input");
  RmsNormArgs a = check_rms_norm(out, input, weight);
  const c10::cuda::CUDAGuard guard(input.device());
  check_launch(gpu::rms_norm(a.out.data, a.out.stride, a.input.data, a.input.stride, a.weight, a.input.count,
                             a.input.width, static_cast<float>(epsilon), a.dtype,
                             c10::cuda::getCurrentCUDAStream()),
               "rms_norm");
}

void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon) {
  check_cuda(input, "input");
  FusedAddRmsNormArgs a = check_fused_add_rms_norm(input, residual, weight);
  const c10::cuda::CUDAGuard guard(input.device());
  check_launch(gpu::fused_add_rms_norm(a.input.data, a.input.stride, a.residual.data, a.residual.stride, a.weight,
                                       a.input.count, a.input.width, static_cast<float>(epsilon), a.dtype,
                                       c10::cuda::getCurrentCUDAStream()),
               "fused_add_rms_norm");
}

void silu_and_mul_cuda(at::Tensor& out, const at::Tensor& input) {
  check_cuda(input, "input");
  SiluAndMulArgs a = check_silu_and_mul(out, input);
  const c10::cuda::CUDAGuard guard(input.device());
  check_launch(gpu::silu_and_mul(a.out.data, a.out.stride, a.input.data, a.input.stride, a.input.count,
                                 a.out.width, a.dtype, c10::cuda::getCurrentCUDAStream()),
               "silu_and_mul");
}

// Positions are not range-checked here: that would need a device sync on every
// call. Callers (the model runner) produce positions below max_model_len, which
// sizes the cache.
void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& query, const c10::optional<at::Tensor>& key,
                           int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  check_cuda(query, "query");
  RotaryArgs a = check_rotary_embedding(positions, query, key, head_size, cos_sin_cache);
  const c10::cuda::CUDAGuard guard(query.device());
  check_launch(gpu::rotary_embedding(a.positions, a.query.data, a.query.stride, a.key, a.key_stride, a.num_tokens,
                                     a.num_heads, a.num_kv_heads, a.head_size, a.cos_sin_cache, a.rot_dim, is_neox,
                                     a.dtype, a.cache_dtype, c10::cuda::getCurrentCUDAStream()),
               "rotary_embedding");
}

constexpr const char* kMixedCacheOnCpu =
    "a bfloat16 KV cache beside float32 keys/queries is supported on the CPU only; on CUDA the cache holds the "
    "model's dtype or float8";

// Slots are not range-checked: that would need a device sync on every call.
// The kernel skips tokens whose slot is outside the cache instead.
void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_cuda(key, "key");
  ReshapeAndCacheArgs a = check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  TORCH_CHECK_VALUE(a.kv_fp8 || a.kv_dtype == a.dtype, kMixedCacheOnCpu);
  // The float8 copy converts 16-byte words of 8 values.
  TORCH_CHECK_VALUE(!a.kv_fp8 || (a.key.width % 8 == 0 && a.key.stride % 8 == 0 && a.value.stride % 8 == 0 &&
                                  reinterpret_cast<uintptr_t>(a.key.data) % 16 == 0 &&
                                  reinterpret_cast<uintptr_t>(a.value.data) % 16 == 0),
                    "reshape_and_cache into a float8 cache needs rows of a multiple of 8 values, 16-byte aligned "
                    "(key ", key.sizes(), " strides ", key.strides(), ")");
  const c10::cuda::CUDAGuard guard(key.device());
  check_launch(gpu::reshape_and_cache(a.key.data, a.key.stride, a.value.data, a.value.stride, a.key_cache,
                                      a.value_cache, a.slot_mapping, a.key.count, a.num_slots, a.key.width, a.dtype,
                                      a.kv_fp8, c10::cuda::getCurrentCUDAStream()),
               "reshape_and_cache");
}

// Positions and slots unchecked, as rotary_embedding_cuda's and
// reshape_and_cache_cuda's.
void rope_and_cache_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& value,
                         at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                         int64_t head_size, const at::Tensor& cos_sin_cache,
                         const c10::optional<at::Tensor>& q_norm_weight,
                         const c10::optional<at::Tensor>& k_norm_weight, bool is_neox, double epsilon) {
  check_cuda(query, "query");
  const RopeAndCacheArgs a = check_rope_and_cache(positions, query, key, value, key_cache, value_cache, slot_mapping,
                                                  head_size, cos_sin_cache, q_norm_weight, k_norm_weight);
  TORCH_CHECK_VALUE(a.cache.kv_fp8 || a.cache.kv_dtype == a.cache.dtype, kMixedCacheOnCpu);
  TORCH_CHECK_VALUE(head_size <= gpu::kRopeAndCacheMaxHeadSize, "rope_and_cache takes heads of up to ",
                    gpu::kRopeAndCacheMaxHeadSize, " elements on CUDA, got head_size ", head_size);
  const RotaryArgs& r = a.rotary;
  const gpu::RopeAndCacheParams p{r.positions,      r.query.data,    r.query.stride,   r.key,
                                  r.key_stride,     a.cache.value.data, a.cache.value.stride, r.num_tokens,
                                  r.num_heads,      r.num_kv_heads,  r.head_size,      r.cos_sin_cache,
                                  r.rot_dim,        a.q_norm_weight, a.k_norm_weight,  static_cast<float>(epsilon),
                                  a.cache.key_cache, a.cache.value_cache, a.cache.slot_mapping, a.cache.num_slots};
  const c10::cuda::CUDAGuard guard(query.device());
  check_launch(gpu::rope_and_cache(p, is_neox, r.dtype, r.cache_dtype, a.cache.kv_fp8,
                                   c10::cuda::getCurrentCUDAStream()),
               "rope_and_cache");
}

int device_attribute(cudaDeviceAttr attribute, int device) {
  int value = 0;
  const cudaError_t status = cudaDeviceGetAttribute(&value, attribute, device);
  TORCH_CHECK(status == cudaSuccess, "cudaDeviceGetAttribute failed: ", cudaGetErrorString(status));
  return value;
}

// The metadata's values (seq_lens, block_tables, query_start_loc) stay on the
// device and are not checked: reading them would sync with the device on every
// call and break CUDA-graph capture. The launch is planned from shapes alone,
// and the kernels clamp what they read (bad values give wrong results, never
// out-of-bounds accesses).
void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale) {
  check_cuda(query, "query");
  PagedAttentionArgs a =
      check_paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK_VALUE(a.kv_fp8 || a.kv_dtype == a.dtype, kMixedCacheOnCpu);
  if (a.query.count == 0) return;
  TORCH_CHECK_VALUE(a.num_seqs > 0, "query has ", a.query.count, " tokens but seq_lens is empty");
  TORCH_CHECK_VALUE(a.max_blocks_per_seq > 0 && a.num_blocks > 0, "query has ", a.query.count,
                    " tokens but block_tables has no columns or the cache no blocks (block_tables ",
                    block_tables.sizes(), ", key_cache ", key_cache.sizes(), ")");
  const c10::cuda::CUDAGuard guard(query.device());
  const int device = query.get_device();
  const int capability = 10 * device_attribute(cudaDevAttrComputeCapabilityMajor, device) +
                         device_attribute(cudaDevAttrComputeCapabilityMinor, device);
  // The kernel widens e4m3 pairs with one instruction that sm_89 introduced.
  TORCH_CHECK_VALUE(!a.kv_fp8 || capability >= 89, "paged_attention: a float8 KV cache needs a GPU of CUDA capability "
                    "8.9 or newer (Ada, Hopper), this one is ", capability / 10, ".", capability % 10);
  const PagedAttentionParams p = paged_attention_params(a, scale);
  const gpu::PagedAttentionPlan plan =
      gpu::plan_paged_attention(p, device_attribute(cudaDevAttrMultiProcessorCount, device),
                                capability / 10);
  TORCH_CHECK_VALUE(plan.error == nullptr, "paged_attention: ", plan.error, " (query ", query.sizes(), ", key_cache ",
                    key_cache.sizes(), ")");
  // Split-K scratch; under graph capture this comes from the graph's pool.
  at::Tensor workspace;
  if (plan.workspace_floats > 0) {
    workspace = at::empty({plan.workspace_floats}, query.options().dtype(at::kFloat));
  }
  check_launch(gpu::paged_attention(p, plan, workspace.defined() ? workspace.data_ptr<float>() : nullptr,
                                    c10::cuda::getCurrentCUDAStream()),
               "paged_attention");
}

void sample_cuda(at::Tensor& out_ids, const at::Tensor& logits, const at::Tensor& temperature,
                 const c10::optional<at::Tensor>& top_k, const c10::optional<at::Tensor>& top_p,
                 const c10::optional<at::Tensor>& min_p, const at::Tensor& seeds, const at::Tensor& offsets) {
  check_cuda(logits, "logits");
  SampleArgs a = check_sample(out_ids, logits, temperature, top_k, top_p, min_p, seeds, offsets);
  TORCH_CHECK_VALUE(a.logits.width <= gpu::kSampleMaxVocab, "logits has a vocabulary of ", a.logits.width,
                    " tokens; pagoda::sample takes at most ", gpu::kSampleMaxVocab);
  TORCH_CHECK_VALUE(a.logits.count <= INT_MAX, "logits has ", a.logits.count, " rows; at most ", INT_MAX);
  const c10::cuda::CUDAGuard guard(logits.device());
  check_launch(gpu::sample(a.out_ids, a.logits.data, a.logits.stride, a.logits.count, a.logits.width, a.dtype,
                           a.temperature, a.top_k, a.top_p, a.min_p, a.seeds, a.offsets,
                           c10::cuda::getCurrentCUDAStream()),
               "sample");
}

}  // namespace
}  // namespace pagoda

TORCH_LIBRARY_IMPL(pagoda, CUDA, m) {
  m.impl("rms_norm", &pagoda::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &pagoda::fused_add_rms_norm_cuda);
  m.impl("silu_and_mul", &pagoda::silu_and_mul_cuda);
  m.impl("rotary_embedding", &pagoda::rotary_embedding_cuda);
  m.impl("reshape_and_cache", &pagoda::reshape_and_cache_cuda);
  m.impl("rope_and_cache", &pagoda::rope_and_cache_cuda);
  m.impl("paged_attention", &pagoda::paged_attention_cuda);
  m.impl("sample", &pagoda::sample_cuda);
}
