// Element types shared by the CPU and GPU kernels. Kernels take raw pointers and
// this tag instead of at::Tensor so that they compile without torch headers.
#pragma once

#include <cstdint>

namespace pagoda {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

}  // namespace pagoda
