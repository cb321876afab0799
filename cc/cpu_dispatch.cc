#include "cc/cpu_dispatch.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

namespace pagoda {
namespace cpu {
namespace {

#define PAGODA_KERNEL_TABLE(ns)                                                                           \
  KernelTable {                                                                                           \
    #ns, &ns::rms_norm, &ns::fused_add_rms_norm, &ns::silu_and_mul, &ns::rotary_embedding,                \
        &ns::reshape_and_cache, &ns::paged_attention, &ns::linear, &ns::gguf_linear, &ns::gguf_embedding,        \
        &ns::gguf_to_panels, &ns::gumbel_argmax                                                             \
  }

// Best first.
std::vector<KernelTable> compiled_tables() {
  std::vector<KernelTable> tables;
#ifdef PAGODA_HAVE_AVX512
  // The AVX512 build with its bf16 linear on VDPBF16PS.
  KernelTable bf16 = PAGODA_KERNEL_TABLE(avx512);
  bf16.isa = "avx512_bf16";
  bf16.linear = &avx512::linear_avx512_bf16;
  tables.push_back(bf16);
  tables.push_back(PAGODA_KERNEL_TABLE(avx512));
#endif
#ifdef PAGODA_HAVE_AVX2
  tables.push_back(PAGODA_KERNEL_TABLE(avx2));
#endif
  return tables;
}

bool cpu_supports(const std::string& isa) {
  __builtin_cpu_init();
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  if (isa == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  }
  if (isa == "avx512_bf16") return cpu_supports("avx512") && __builtin_cpu_supports("avx512bf16");
  return false;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out.empty() ? "none" : out;
}

std::mutex selection_mutex;
std::atomic<const KernelTable*> selected{nullptr};

}  // namespace

std::vector<std::string> compiled_isas() {
  std::vector<std::string> names;
  for (const auto& table : compiled_tables()) names.push_back(table.isa);
  return names;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const auto& name : compiled_isas()) {
    if (cpu_supports(name)) names.push_back(name);
  }
  return names;
}

void select_isa(const std::string& isa) {
  static const std::vector<KernelTable> tables = compiled_tables();
  for (const auto& table : tables) {
    if (!isa.empty() && isa != table.isa) continue;
    if (!cpu_supports(table.isa)) {
      if (isa.empty()) continue;
      throw std::invalid_argument("PAGODA_CPU_ISA=" + isa + ": this CPU does not support it (usable here: " +
                                  join(supported_isas()) + ")");
    }
    std::lock_guard<std::mutex> lock(selection_mutex);
    selected.store(&table);
    return;
  }
  if (isa.empty()) {
    throw std::invalid_argument("no CPU kernel build usable on this CPU (compiled: " + join(compiled_isas()) +
                                "; the CPU needs at least AVX2 and FMA)");
  }
  throw std::invalid_argument("PAGODA_CPU_ISA=" + isa + " is not compiled into this build (compiled: " +
                              join(compiled_isas()) + ")");
}

const KernelTable& kernels() {
  const KernelTable* table = selected.load();
  if (table == nullptr) {
    const char* forced = std::getenv("PAGODA_CPU_ISA");
    select_isa(forced == nullptr ? "" : forced);
    table = selected.load();
  }
  return *table;
}

}  // namespace cpu
}  // namespace pagoda
