// torch.ops.pagoda.*: the op schemas and their CPU implementations (the fake
// implementations for torch.compile are in python/pagoda/ops.py).
// The CUDA implementations live in cc/cuda_ops.cc (a separate library, loaded
// only beside a CUDA build of torch).
#include <torch/library.h>

#include <stdexcept>
#include <tuple>

#include "cc/cpu_dispatch.h"
#include "cc/tensor_checks.h"

namespace pagoda {
namespace {

const cpu::KernelTable& cpu_kernels() {
  try {
    return cpu::kernels();
  } catch (const std::invalid_argument& error) {
    C10_THROW_ERROR(ValueError, error.what());
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU for this kernel, got ", t.device());
}

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check_cpu(input, "input");
  RmsNormArgs a = check_rms_norm(out, input, weight);
  cpu_kernels().rms_norm(a.out.data, a.out.stride, a.input.data, a.input.stride, a.weight, a.input.count,
                         a.input.width, static_cast<float>(epsilon), a.dtype);
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon) {
  check_cpu(input, "input");
  FusedAddRmsNormArgs a = check_fused_add_rms_norm(input, residual, weight);
  cpu_kernels().fused_add_rms_norm(a.input.data, a.input.stride, a.residual.data, a.residual.stride, a.weight,
                                   a.input.count, a.input.width, static_cast<float>(epsilon), a.dtype);
}

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  check_cpu(input, "input");
  SiluAndMulArgs a = check_silu_and_mul(out, input);
  cpu_kernels().silu_and_mul(a.out.data, a.out.stride, a.input.data, a.input.stride, a.input.count, a.out.width,
                             a.dtype);
}

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query, const c10::optional<at::Tensor>& key,
                          int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  check_cpu(query, "query");
  RotaryArgs a = check_rotary_embedding(positions, query, key, head_size, cos_sin_cache);
  // The kernel indexes the cache by position: reject out-of-range positions
  // here rather than read out of bounds (cheap on the CPU; no device sync).
  for (int64_t i = 0; i < a.num_tokens; ++i) {
    TORCH_CHECK_VALUE(a.positions[i] >= 0 && a.positions[i] < a.max_position, "positions[", i, "] = ",
                      a.positions[i], " is outside the cos_sin_cache's [0, ", a.max_position, ")");
  }
  cpu_kernels().rotary_embedding(a.positions, a.query.data, a.query.stride, a.key, a.key_stride, a.num_tokens,
                                 a.num_heads, a.num_kv_heads, a.head_size, a.cos_sin_cache, a.rot_dim, is_neox,
                                 a.dtype, a.cache_dtype);
}

constexpr const char* kFp8CacheOnGpu = "a float8 KV cache is supported on CUDA GPUs only";

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_cpu(key, "key");
  ReshapeAndCacheArgs a = check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  TORCH_CHECK_VALUE(!a.kv_fp8, kFp8CacheOnGpu);
  // The kernel writes row slot_mapping[t] of the cache: reject slots past its
  // end here (negative slots mark padding tokens and are skipped).
  for (int64_t t = 0; t < a.key.count; ++t) {
    TORCH_CHECK_VALUE(a.slot_mapping[t] < a.num_slots, "slot_mapping[", t, "] = ", a.slot_mapping[t],
                      " is outside the cache's ", a.num_slots, " slots (num_blocks x block_size)");
  }
  cpu_kernels().reshape_and_cache(a.key.data, a.key.stride, a.value.data, a.value.stride, a.key_cache,
                                  a.value_cache, a.slot_mapping, a.key.count, a.key.width, a.dtype, a.kv_dtype);
}

// The three ops in turn (on CUDA, one kernel: cuda/rope_and_cache.cu).
void rope_and_cache_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& value,
                        at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                        int64_t head_size, const at::Tensor& cos_sin_cache,
                        const c10::optional<at::Tensor>& q_norm_weight, const c10::optional<at::Tensor>& k_norm_weight,
                        bool is_neox, double epsilon) {
  check_cpu(query, "query");
  const RopeAndCacheArgs a = check_rope_and_cache(positions, query, key, value, key_cache, value_cache, slot_mapping,
                                                  head_size, cos_sin_cache, q_norm_weight, k_norm_weight);
  const int64_t num_tokens = a.rotary.num_tokens;
  for (auto [x, heads, weight] : {std::make_tuple(&query, a.rotary.num_heads, &q_norm_weight),
                                  std::make_tuple(&key, a.rotary.num_kv_heads, &k_norm_weight)}) {
    if (!weight->has_value()) continue;
    const at::Tensor per_head = x->view({num_tokens, heads, head_size});
    for (int64_t h = 0; h < heads; ++h) {
      at::Tensor rows = per_head.select(1, h);
      rms_norm_cpu(rows, rows, **weight, epsilon);
    }
  }
  rotary_embedding_cpu(positions, query, key, head_size, cos_sin_cache, is_neox);
  reshape_and_cache_cpu(key.view({num_tokens, a.rotary.num_kv_heads, head_size}),
                        value.view({num_tokens, a.rotary.num_kv_heads, head_size}), key_cache, value_cache,
                        slot_mapping);
}

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, double scale) {
  check_cpu(query, "query");
  PagedAttentionArgs a =
      check_paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK_VALUE(!a.kv_fp8, kFp8CacheOnGpu);
  check_paged_attention_metadata(a);
  cpu_kernels().paged_attention(paged_attention_params(a, scale));
}

void linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias) {
  check_cpu(input, "input");
  LinearArgs a = check_linear(out, input, weight, bias);
  cpu_kernels().linear(a.out.data, a.out.stride, a.input.data, a.input.stride, a.weight, a.bias, a.M, a.N, a.K,
                       a.dtype);
}

void gguf_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, int64_t weight_type,
                     const c10::optional<at::Tensor>& bias, bool quantize_input) {
  check_cpu(input, "input");
  GgufLinearArgs a = check_gguf_linear(out, input, weight, weight_type, bias);
  cpu_kernels().gguf_linear(static_cast<float*>(a.out.data), a.out.stride, static_cast<const float*>(a.input.data),
                            a.input.stride, a.weight, static_cast<cpu::GgufType>(weight_type), a.bias, a.M, a.N,
                            a.K, quantize_input);
}

void gguf_embedding_cpu(at::Tensor& out, const at::Tensor& ids, const at::Tensor& weight, int64_t weight_type,
                        bool panels) {
  check_cpu(ids, "ids");
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong, "ids must be int64, got ", ids.scalar_type());
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "out must be float32, got ", out.scalar_type());
  check_same_device(weight, "weight", ids, "ids");
  check_same_device(out, "out", ids, "ids");
  TORCH_CHECK_VALUE(ids.is_contiguous(), "ids must be contiguous");
  TORCH_CHECK_VALUE(out.dim() == ids.dim() + 1 && out.sizes().slice(0, ids.dim()) == ids.sizes(),
                    "out must have shape ids.shape + [embedding_dim], got ", out.sizes(), " for ids ", ids.sizes());
  Rows out_rows = as_rows(out, "out");
  check_gguf_weight(weight, weight_type, out_rows.width);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK_VALUE(id[i] >= 0 && id[i] < weight.size(0), "ids[", i, "] = ", id[i], " is outside the table's [0, ",
                      weight.size(0), ")");
  }
  cpu_kernels().gguf_embedding(static_cast<float*>(out_rows.data), out_rows.stride, id, ids.numel(), weight.data_ptr(),
                               static_cast<cpu::GgufType>(weight_type), weight.size(0), out_rows.width, panels);
}

void gguf_to_panels_cpu(at::Tensor& weight, int64_t weight_type, int64_t in_features) {
  check_cpu(weight, "weight");
  check_gguf_weight(weight, weight_type, in_features);
  cpu_kernels().gguf_to_panels(weight.data_ptr(), static_cast<cpu::GgufType>(weight_type), weight.size(0),
                               in_features);
}

// weight_types' entry for a dense [N, K] weight in the activations' dtype,
// multiplied by Pagoda's linear kernel (ops.DENSE_WEIGHT); others are GGUF
// types.
constexpr int64_t kDenseWeight = -1;

// quantize_input: the GGUF formats multiply int8 inputs.
void layer_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, int64_t weight_type,
                  bool quantize_input) {
  const c10::optional<at::Tensor> no_bias;
  if (weight_type == kDenseWeight) {
    linear_cpu(out, input, weight, no_bias);
  } else {
    gguf_linear_cpu(out, input, weight, weight_type, no_bias, quantize_input);
  }
}

// A llama-family model's decoder layers in one call (GGUF-packed linears in
// fp32, or dense ones on Pagoda's linear kernel in any dtype; no biases, one
// rank): the per-layer sequence of LlamaDecoderLayer.forward,
// calling the ops above directly, so that a CPU step pays the Python and
// dispatcher cost of one op instead of about ten per layer, and allocates its
// intermediates once instead of per layer. Same kernels in the same order as
// the per-op path, so the results are the same bit for bit.
//
// hidden comes in as layer 0's input, already normalized (its input_layernorm),
// and residual as the embeddings; both are updated in place, hidden ending as
// the final norm's output. Per layer, weights holds 6 tensors (qkv_proj,
// o_proj, post_attention_layernorm, gate_up_proj, down_proj, and the norm
// that follows the layer: the next layer's input_layernorm, or the model's
// final norm after the last), weight_types the GGUF types of the 4 linears
// (kDenseWeight for a dense one), and kv_caches the key and value cache.
// quantize_input as gguf_linear's, for every packed linear that has it.
void llama_decoder_layers_cpu(at::Tensor& hidden, at::Tensor& residual, const at::Tensor& positions,
                              at::TensorList weights, at::IntArrayRef weight_types, at::TensorList kv_caches,
                              const at::Tensor& cos_sin_cache, bool is_neox, const at::Tensor& slot_mapping,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_size, double scale, double epsilon, bool quantize_input) {
  check_cpu(hidden, "hidden");
  const int64_t num_layers = static_cast<int64_t>(weight_types.size()) / 4;
  TORCH_CHECK_VALUE(static_cast<int64_t>(weight_types.size()) == 4 * num_layers &&
                        static_cast<int64_t>(weights.size()) == 6 * num_layers &&
                        static_cast<int64_t>(kv_caches.size()) == 2 * num_layers,
                    "per layer, weights needs 6 tensors, weight_types 4 and kv_caches 2; got ", weights.size(), ", ",
                    weight_types.size(), " and ", kv_caches.size());
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be a contiguous [num_tokens, hidden], got ",
                    hidden.sizes());
  if (num_layers == 0) return;
  const int64_t num_tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
  const int64_t intermediate = weights[3].size(0) / 2;
  const auto options = hidden.options();
  at::Tensor qkv = at::empty({num_tokens, q_size + 2 * kv_size}, options);
  at::Tensor q = qkv.narrow(1, 0, q_size);
  c10::optional<at::Tensor> k = qkv.narrow(1, q_size, kv_size);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
  const at::Tensor q_heads = q.view({num_tokens, num_heads, head_size});
  const at::Tensor k_heads = k->view({num_tokens, num_kv_heads, head_size});
  const at::Tensor v_heads = v.view({num_tokens, num_kv_heads, head_size});
  at::Tensor attn = at::empty({num_tokens, num_heads, head_size}, options);
  const at::Tensor attn_rows = attn.view({num_tokens, q_size});
  at::Tensor x = at::empty_like(hidden);
  at::Tensor gate_up = at::empty({num_tokens, 2 * intermediate}, options);
  at::Tensor act = at::empty({num_tokens, intermediate}, options);
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + 6 * l;
    const int64_t* type = weight_types.data() + 4 * l;
    at::Tensor key_cache = kv_caches[2 * l], value_cache = kv_caches[2 * l + 1];
    layer_linear(qkv, hidden, w[0], type[0], quantize_input);
    rotary_embedding_cpu(positions, q, k, head_size, cos_sin_cache, is_neox);
    reshape_and_cache_cpu(k_heads, v_heads, key_cache, value_cache, slot_mapping);
    paged_attention_cpu(attn, q_heads, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale);
    layer_linear(x, attn_rows, w[1], type[1], quantize_input);
    fused_add_rms_norm_cpu(x, residual, w[2], epsilon);
    layer_linear(gate_up, x, w[3], type[2], quantize_input);
    silu_and_mul_cpu(act, gate_up);
    layer_linear(hidden, act, w[4], type[3], quantize_input);
    fused_add_rms_norm_cpu(hidden, residual, w[5], epsilon);
  }
}

// seeds and offsets undefined (greedy_argmax): no noise, the greedy argmax.
void gumbel_argmax_cpu(at::Tensor& out, const at::Tensor& logits, const at::Tensor& seeds,
                       const at::Tensor& offsets) {
  check_cpu(logits, "logits");
  TORCH_CHECK_TYPE(logits.scalar_type() == at::kFloat, "logits must be float32, got ", logits.scalar_type());
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be [num_rows, vocab_size], got shape ", logits.sizes());
  const Rows rows = as_rows(logits, "logits");
  auto check_per_row = [&](const at::Tensor& t, const char* name) {
    check_same_device(t, name, logits, "logits");
    check_index_vector(t, name, at::kLong, "int64", rows.count, "num_rows");
  };
  check_per_row(out, "out");
  const bool race = seeds.defined();
  if (race) {
    check_per_row(seeds, "seeds");
    check_per_row(offsets, "offsets");
  }
  cpu_kernels().gumbel_argmax(out.data_ptr<int64_t>(), static_cast<const float*>(rows.data), rows.stride,
                              race ? seeds.data_ptr<int64_t>() : nullptr,
                              race ? offsets.data_ptr<int64_t>() : nullptr, rows.count, rows.width);
}

void greedy_argmax_cpu(at::Tensor& out, const at::Tensor& logits) { gumbel_argmax_cpu(out, logits, {}, {}); }

// The whole of sampling runs on the GPU only (cuda/sampling.cu); on the CPU,
// Sampler filters with torch ops and races with gumbel_argmax. Registered so
// that a CPU call says so instead of listing backends.
void sample_cpu(at::Tensor&, const at::Tensor& logits, const at::Tensor&, const c10::optional<at::Tensor>&,
                const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, const at::Tensor&,
                const at::Tensor&) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "pagoda::sample has no CPU kernel: logits is on ", logits.device(),
                              "; pass CUDA tensors (on the CPU, Sampler filters with torch ops and races with "
                              "pagoda::gumbel_argmax)");
}

}  // namespace
}  // namespace pagoda

TORCH_LIBRARY(pagoda, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "rope_and_cache(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value, Tensor(c!) key_cache, "
      "Tensor(d!) value_cache, Tensor slot_mapping, int head_size, Tensor cos_sin_cache, Tensor? q_norm_weight, "
      "Tensor? k_norm_weight, bool is_neox, float epsilon) -> ()");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale) -> ()");
  m.def("linear(Tensor(a!) out, Tensor input, Tensor weight, Tensor? bias) -> ()");
  m.def(
      "gguf_linear(Tensor(a!) out, Tensor input, Tensor weight, int weight_type, Tensor? bias, "
      "bool quantize_input=False) -> ()");
  m.def("gguf_embedding(Tensor(a!) out, Tensor ids, Tensor weight, int weight_type, bool panels=False) -> ()");
  m.def("gguf_to_panels(Tensor(a!) weight, int weight_type, int in_features) -> ()");
  m.def(
      "llama_decoder_layers(Tensor(a!) hidden, Tensor(b!) residual, Tensor positions, Tensor[] weights, "
      "int[] weight_types, Tensor(c!)[] kv_caches, Tensor cos_sin_cache, bool is_neox, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int num_heads, int num_kv_heads, "
      "int head_size, float scale, float epsilon, bool quantize_input=False) -> ()");
  m.def("gumbel_argmax(Tensor(a!) out, Tensor logits, Tensor seeds, Tensor offsets) -> ()");
  m.def("greedy_argmax(Tensor(a!) out, Tensor logits) -> ()");
  m.def(
      "sample(Tensor(a!) out_ids, Tensor logits, Tensor temperature, Tensor? top_k, Tensor? top_p, Tensor? min_p, "
      "Tensor seeds, Tensor offsets) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("rms_norm", &pagoda::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &pagoda::fused_add_rms_norm_cpu);
  m.impl("silu_and_mul", &pagoda::silu_and_mul_cpu);
  m.impl("rotary_embedding", &pagoda::rotary_embedding_cpu);
  m.impl("reshape_and_cache", &pagoda::reshape_and_cache_cpu);
  m.impl("rope_and_cache", &pagoda::rope_and_cache_cpu);
  m.impl("paged_attention", &pagoda::paged_attention_cpu);
  m.impl("linear", &pagoda::linear_cpu);
  m.impl("gguf_linear", &pagoda::gguf_linear_cpu);
  m.impl("gguf_embedding", &pagoda::gguf_embedding_cpu);
  m.impl("gguf_to_panels", &pagoda::gguf_to_panels_cpu);
  m.impl("llama_decoder_layers", &pagoda::llama_decoder_layers_cpu);
  m.impl("gumbel_argmax", &pagoda::gumbel_argmax_cpu);
  m.impl("greedy_argmax", &pagoda::greedy_argmax_cpu);
  m.impl("sample", &pagoda::sample_cpu);
}
