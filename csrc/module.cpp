// Python bindings of the fastdp native extension (fastdp._C).
// Kernels take NumPy views of contiguous CPU tensors (no torch headers needed).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <vector>

#include "noise.h"

namespace py = pybind11;

namespace {

void check_contiguous(const py::array& a, const char* what) {
  if (!(a.flags() & py::array::c_style)) throw std::invalid_argument(std::string(what) + " must be C-contiguous");
}

void noisy_average(const std::vector<py::array>& src, std::vector<py::array>& dst, double std, double divisor,
                   uint64_t seed) {
  if (src.size() != dst.size()) throw std::invalid_argument("src and dst lists differ in length");
  std::vector<fastdp::NoiseTensor> tensors;
  for (size_t i = 0; i < src.size(); ++i) {
    check_contiguous(src[i], "src");
    check_contiguous(dst[i], "dst");
    const bool f32 = src[i].dtype().is(py::dtype::of<float>()), f64 = src[i].dtype().is(py::dtype::of<double>());
    if (!(f32 || f64) || !dst[i].dtype().is(src[i].dtype()) || dst[i].size() != src[i].size())
      throw std::invalid_argument("src/dst must be float32 or float64 arrays of equal dtype and size");
    if (!dst[i].writeable()) throw std::invalid_argument("dst must be writeable");
    tensors.push_back({src[i].data(), dst[i].mutable_data(), static_cast<int64_t>(src[i].size()),
                       static_cast<uint32_t>(i), f64});
  }
  py::gil_scoped_release release;
  fastdp::noisy_average(tensors, std, divisor, seed);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastdp native CPU kernels";
  m.def("version", []() { return std::string("0.1.0"); }, "Version of the native extension.");
  m.def("noisy_average", &noisy_average, py::arg("src"), py::arg("dst"), py::arg("std"), py::arg("divisor"),
        py::arg("seed"),
        "dst[i] = (src[i] + std * z_i) / divisor, z_i ~ N(0, 1) from Philox keyed by seed, counter by (i, element).");
}
