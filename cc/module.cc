// pagoda._C: the Python module. Loading it registers torch.ops.pagoda.* (the
// TORCH_LIBRARY blocks linked in from cc/torch_ops.cc); the functions here
// report how the library was built and pick the CPU kernel build.
//
// This file includes pybind11 but no torch headers: torch bundles its own
// pybind11, and keeping the two apart avoids mixing their versions.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "cc/cpu_dispatch.h"

extern "C" const char pagoda_build_info[];

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "Pagoda's compiled kernels; the ops are torch.ops.pagoda.*";
  py::register_exception<std::invalid_argument>(m, "IsaError", PyExc_ValueError);
  m.def(
      "build_info", [] { return std::string(pagoda_build_info); },
      "The torch version and C++ ABI this library was built against.");
  m.def("compiled_cpu_isas", &pagoda::cpu::compiled_isas, "CPU kernel builds in this library, best first.");
  m.def("supported_cpu_isas", &pagoda::cpu::supported_isas, "Compiled CPU kernel builds this CPU can run.");
  m.def(
      "select_cpu_isa", &pagoda::cpu::select_isa, py::arg("isa"),
      "Use the named CPU kernel build ('' = the best this CPU supports); ValueError if unusable.");
  m.def(
      "cpu_isa", [] { return std::string(pagoda::cpu::kernels().isa); },
      "The CPU kernel build in use.");
}
