// CUDA implementations of torch.ops.pagoda.* (schemas in cc/torch_ops.cc).
// Built into its own library (python/pagoda:_cuda_ops.so) that the Python
// package loads only beside a CUDA build of torch.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

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

}  // namespace
}  // namespace pagoda

TORCH_LIBRARY_IMPL(pagoda, CUDA, m) {
  m.impl("rms_norm", &pagoda::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &pagoda::fused_add_rms_norm_cuda);
  m.impl("silu_and_mul", &pagoda::silu_and_mul_cuda);
  m.impl("rotary_embedding", &pagoda::rotary_embedding_cuda);
}
