// Chooses one build of the CPU kernels (AVX2 or AVX512) for the process:
// the best the CPU supports among those compiled in, or the one named by the
// PAGODA_CPU_ISA environment variable (for tests and benchmarks).
// "avx512_bf16" is the AVX512 build with its bf16 linear on VDPBF16PS (CPUs
// with AVX512_BF16); forcing "avx512" there runs the fp32-FMA fallback.
#pragma once

#include <string>
#include <vector>

#include "cc/cpu/kernels.h"

namespace pagoda {
namespace cpu {

struct KernelTable {
  const char* isa;
  decltype(&avx2::rms_norm) rms_norm;
  decltype(&avx2::fused_add_rms_norm) fused_add_rms_norm;
  decltype(&avx2::silu_and_mul) silu_and_mul;
  decltype(&avx2::rotary_embedding) rotary_embedding;
  decltype(&avx2::reshape_and_cache) reshape_and_cache;
  decltype(&avx2::paged_attention) paged_attention;
  decltype(&avx2::linear) linear;
  decltype(&avx2::gguf_linear) gguf_linear;
  decltype(&avx2::gguf_embedding) gguf_embedding;
  decltype(&avx2::gguf_to_panels) gguf_to_panels;
  decltype(&avx2::gumbel_argmax) gumbel_argmax;
};

// The selected kernels; selects from PAGODA_CPU_ISA on first use and throws
// std::invalid_argument if that names an ISA that is not usable here.
const KernelTable& kernels();

// Selects an ISA by name ("" = best available). Throws std::invalid_argument
// naming the choices when `isa` is not compiled in or not supported by this CPU.
void select_isa(const std::string& isa);

// ISAs compiled into this build, and those of them this CPU can run.
std::vector<std::string> compiled_isas();
std::vector<std::string> supported_isas();

}  // namespace cpu
}  // namespace pagoda
