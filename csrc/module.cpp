// Python bindings of the fastdp native extension (fastdp._C).
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastdp native CPU kernels";
  m.def("version", []() { return std::string("0.1.0"); }, "Version of the native extension.");
}
