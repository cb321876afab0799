// What this binary was built against, kept as a plain string inside each
// shared object so that python/pagoda/_native.py can read it *before* loading
// the library: a library built for another torch fails to load with an
// unhelpful "undefined symbol", so the loader refuses it with a clear message.
#include <torch/version.h>

#include <cstddef>  // libstdc++ defines _GLIBCXX_USE_CXX11_ABI in its config header

#define PAGODA_STR2(x) #x
#define PAGODA_STR(x) PAGODA_STR2(x)

extern "C" __attribute__((used, visibility("default"))) const char pagoda_build_info[] =
    "PAGODA_BUILD_INFO{torch=" TORCH_VERSION ";cxx11_abi=" PAGODA_STR(_GLIBCXX_USE_CXX11_ABI) "}";
