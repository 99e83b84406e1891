// Python bindings of the fastdp native extension (fastdp._C).
// Kernels take NumPy views of CPU tensors, or for the small per-step ones their addresses
// (no torch headers needed either way).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <optional>
#include <stdexcept>
#include <vector>

#include "coefficients.h"
#include "embedding_norms.h"
#include "group_norm.h"
#include "linear_norms.h"
#include "noise.h"
#include "row_norms.h"

namespace py = pybind11;

namespace {

// The per-step kernels called once per parameter or per layer (noise, per-sample norms,
// totals, clipping factors, convolution norms) take the addresses of contiguous CPU tensors as Python ints
// (tensor.data_ptr()) with their sizes: a NumPy view costs four dispatcher calls per tensor,
// more than these kernels on small tensors. The Python wrappers in fastdp/_native_ops.py
// make the operands contiguous, check their dtypes and allocate the outputs.
template <typename T>
T* at(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void noisy_average(const std::vector<uintptr_t>& src, const std::vector<uintptr_t>& dst,
                   const std::vector<int64_t>& numel, double std, double divisor, uint64_t seed) {
  const size_t n = src.size();
  if (dst.size() != n || numel.size() != n) throw std::invalid_argument("src, dst and numel differ in length");
  std::vector<fastdp::NoiseTensor> tensors;
  for (size_t i = 0; i < n; ++i)
    tensors.push_back({at<const void>(src[i]), at<void>(dst[i]), numel[i], static_cast<uint32_t>(i)});
  py::gil_scoped_release release;
  fastdp::noisy_average(tensors, std, divisor, seed);
}

template <typename T>
void embedding_sq_norms_t(const py::array_t<int64_t, py::array::c_style>& ids,
                          const py::array_t<T, py::array::c_style>& g, bool has_padding, int64_t padding_idx,
                          py::array_t<double, py::array::c_style>& out) {
  if (ids.ndim() != 2 || g.ndim() != 3 || g.shape(0) != ids.shape(0) || g.shape(1) != ids.shape(1) ||
      out.ndim() != 1 || out.shape(0) != ids.shape(0))
    throw std::invalid_argument("expected ids (B, T), g (B, T, D), out (B,)");
  const int64_t* ids_p = ids.data();
  const T* g_p = g.data();
  double* out_p = out.mutable_data();
  py::gil_scoped_release release;
  fastdp::embedding_sq_norms<T>(ids_p, g_p, g.shape(0), g.shape(1), g.shape(2), has_padding, padding_idx, out_p);
}

// A (B, T, K) NumPy array of F as a strided view (strides in elements; any layout).
template <typename F>
fastdp::Strided3<F> strided3(const py::array_t<F>& x) {
  return {x.data(), x.shape(0), x.shape(1), x.shape(2), static_cast<int64_t>(x.strides(0) / sizeof(F)),
          static_cast<int64_t>(x.strides(1) / sizeof(F)), static_cast<int64_t>(x.strides(2) / sizeof(F))};
}

template <typename F, void (*kernel)(const fastdp::Strided3<F>&, const fastdp::Strided3<F>&, double*)>
void linear_sq_norms_t(const py::array_t<F>& a, const py::array_t<F>& g, py::array_t<double, py::array::c_style>& out) {
  if (a.ndim() != 3 || g.ndim() != 3 || g.shape(0) != a.shape(0) || g.shape(1) != a.shape(1) || out.ndim() != 1 ||
      out.shape(0) != a.shape(0))
    throw std::invalid_argument("expected a (B, T, d), g (B, T, p), out (B,)");
  for (const py::array* x : {static_cast<const py::array*>(&a), static_cast<const py::array*>(&g)})
    for (int k = 0; k < 3; ++k)
      if (x->strides(k) < 0 || x->strides(k) % static_cast<py::ssize_t>(sizeof(F)) != 0)
        throw std::invalid_argument("a and g need non-negative strides in whole elements");
  const auto av = strided3(a), gv = strided3(g);
  double* out_p = out.mutable_data();
  py::gil_scoped_release release;
  kernel(av, gv, out_p);
}

// shape: (B, C, H, W, C_out, OH, OW) of x and g; geometry: (groups, kernel_h, kernel_w,
// stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w). Addresses as for the per-step
// kernels (called once per convolution layer and backward); grads, bias_grads and grad_input
// may be 0, weight too where grad_input is.
// Returns whether every norm is finite: the wide layout multiplies zero output gradients by input
// columns no output reads, so a NaN/Inf there (which the layer never sees) makes a norm NaN.
bool conv2d_sq_norms(uintptr_t x, uintptr_t g, const std::vector<int64_t>& shape, const std::vector<int64_t>& geometry,
                     bool is_double, bool ghost, uintptr_t out, uintptr_t grads, uintptr_t bias_grads,
                     uintptr_t weight, uintptr_t grad_input) {
  if (shape.size() != 7 || geometry.size() != 9) throw std::invalid_argument("expected 7 shape and 9 geometry values");
  const fastdp::Conv2dGeometry c{shape[0],    shape[1],    shape[2],    shape[3],    shape[4],    shape[5],
                                 shape[6],    geometry[0], geometry[1], geometry[2], geometry[3], geometry[4],
                                 geometry[5], geometry[6], geometry[7], geometry[8]};
  if (c.batch < 0 || c.groups < 1 || c.channels % c.groups || c.out_channels % c.groups || c.kernel_h < 1 ||
      c.kernel_w < 1 || c.stride_h < 1 || c.stride_w < 1 || c.dilation_h < 1 || c.dilation_w < 1 || c.pad_h < 0 ||
      c.pad_w < 0 || c.out_height != (c.height + 2 * c.pad_h - c.dilation_h * (c.kernel_h - 1) - 1) / c.stride_h + 1 ||
      c.out_width != (c.width + 2 * c.pad_w - c.dilation_w * (c.kernel_w - 1) - 1) / c.stride_w + 1)
    throw std::invalid_argument("convolution geometry does not match the shapes of x and g");
  if (ghost && grads) throw std::invalid_argument("grads: only the direct route writes them");
  if (grad_input && !weight) throw std::invalid_argument("grad_input needs the weight");
  py::gil_scoped_release release;
  if (is_double)
    fastdp::conv2d_sq_norms<double>(at<const double>(x), at<const double>(g), c, ghost, at<double>(out),
                                    at<double>(grads), at<double>(bias_grads), at<const double>(weight),
                                    at<double>(grad_input));
  else
    fastdp::conv2d_sq_norms<float>(at<const float>(x), at<const float>(g), c, ghost, at<double>(out),
                                   at<float>(grads), at<float>(bias_grads), at<const float>(weight),
                                   at<float>(grad_input));
  const double* norms = at<const double>(out);
  for (int64_t i = 0; i < c.batch; ++i)
    if (!std::isfinite(norms[i])) return false;
  return true;
}

// x, dy (N, C, HW); mean, rstd (N, G); gamma (C) or None; dx (N, C, HW) or None; dgamma, dbeta (N, C).
template <typename F>
void group_norm_backward_t(const py::array_t<F, py::array::c_style>& x, const py::array_t<F, py::array::c_style>& dy,
                           const py::array_t<F, py::array::c_style>& mean,
                           const py::array_t<F, py::array::c_style>& rstd,
                           std::optional<py::array_t<F, py::array::c_style>> gamma, int64_t groups,
                           std::optional<py::array_t<F, py::array::c_style>> dx,
                           py::array_t<F, py::array::c_style>& dgamma, py::array_t<F, py::array::c_style>& dbeta) {
  if (x.ndim() != 3 || dy.ndim() != 3 || groups < 1)
    throw std::invalid_argument("expected x and dy (N, C, HW) and groups >= 1");
  const int64_t n = x.shape(0), c = x.shape(1), hw = x.shape(2);
  if (c % groups || dy.shape(0) != n || dy.shape(1) != c || dy.shape(2) != hw || mean.size() != n * groups ||
      rstd.size() != n * groups || (gamma && gamma->size() != c) || (dx && dx->size() != x.size()) ||
      dgamma.size() != n * c || dbeta.size() != n * c)
    throw std::invalid_argument("group_norm_backward: shapes do not match x (N, C, HW) and groups");
  const F* gamma_p = gamma ? gamma->data() : nullptr;
  F* dx_p = dx ? dx->mutable_data() : nullptr;
  const F *x_p = x.data(), *dy_p = dy.data(), *mean_p = mean.data(), *rstd_p = rstd.data();
  F *dgamma_p = dgamma.mutable_data(), *dbeta_p = dbeta.mutable_data();
  py::gil_scoped_release release;
  fastdp::group_norm_backward<F>(x_p, dy_p, mean_p, rstd_p, gamma_p, n, c, hw, groups, dx_p, dgamma_p, dbeta_p);
}

bool total_sq_norms(const std::vector<uintptr_t>& parts, int64_t batch, uintptr_t total) {
  std::vector<const double*> ptrs;
  for (uintptr_t part : parts) ptrs.push_back(at<const double>(part));
  return fastdp::total_sq_norms(ptrs, batch, at<double>(total));
}

void clip_factors(uintptr_t total, int64_t batch, double bound, double scale, double offset, bool clamp,
                  uintptr_t out) {
  if (!(scale > 0)) throw std::invalid_argument("scale must be > 0");
  fastdp::clip_factors(at<const double>(total), batch, bound, scale, offset, clamp, at<double>(out));
}

void rows_sq_norms(uintptr_t x, int64_t rows, int64_t cols, bool is_double, uintptr_t out) {
  py::gil_scoped_release release;
  if (is_double)
    fastdp::rows_sq_norms(at<const double>(x), rows, cols, at<double>(out));
  else
    fastdp::rows_sq_norms(at<const float>(x), rows, cols, at<double>(out));
}

void outer_sq_norms(uintptr_t a, uintptr_t g, int64_t batch, int64_t d, int64_t p, bool is_double, uintptr_t weight,
                    uintptr_t bias) {
  py::gil_scoped_release release;
  if (is_double)
    fastdp::outer_sq_norms(at<const double>(a), at<const double>(g), batch, d, p, at<double>(weight), at<double>(bias));
  else
    fastdp::outer_sq_norms(at<const float>(a), at<const float>(g), batch, d, p, at<double>(weight), at<double>(bias));
}

// Binds the float32 and float64 instantiations of one kernel under one name (pybind11
// picks the overload whose arrays match, since they are declared noconvert).
template <typename F32, typename F64, typename... Args>
void def_per_dtype(py::module_& m, const char* name, F32 f32, F64 f64, const char* doc, const Args&... args) {
  m.def(name, f32, args..., doc);
  m.def(name, f64, args..., doc);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastdp native CPU kernels";
  // Bumped with every change of a binding's signature or meaning: fastdp._native_ops refuses a
  // build whose number differs (a stale in-place build), and the references run instead.
  m.attr("BINDINGS") = 3;
  m.def("noisy_average", &noisy_average, py::arg("src"), py::arg("dst"), py::arg("numel"), py::arg("std"),
        py::arg("divisor"), py::arg("seed"),
        "dst[i] = (src[i] + std * z_i) / divisor, z_i ~ N(0, 1) from Philox keyed by seed, counter by (i, element) "
        "(addresses of contiguous float32 buffers of numel[i] elements; dst[i] may be src[i]).");
  def_per_dtype(m, "embedding_sq_norms", &embedding_sq_norms_t<float>, &embedding_sq_norms_t<double>,
                "out[i] = squared norm of sample i's embedding weight gradient (ids (B,T), g (B,T,D)).", py::arg("ids"),
                py::arg("g").noconvert(), py::arg("has_padding"), py::arg("padding_idx"), py::arg("out").noconvert());
  def_per_dtype(
      m, "linear_sq_norms_ghost", &linear_sq_norms_t<float, fastdp::linear_sq_norms_ghost<float>>,
      &linear_sq_norms_t<double, fastdp::linear_sq_norms_ghost<double>>,
      "out[i] = ||g_i^T a_i||_F^2 from tiled Gram matrices (a (B,T,d), g (B,T,p), any strides; out (B,) float64).",
      py::arg("a").noconvert(), py::arg("g").noconvert(), py::arg("out").noconvert());
  def_per_dtype(
      m, "linear_sq_norms_direct", &linear_sq_norms_t<float, fastdp::linear_sq_norms_direct<float>>,
      &linear_sq_norms_t<double, fastdp::linear_sq_norms_direct<double>>,
      "out[i] = ||g_i^T a_i||_F^2 from tiles of g_i^T a_i (a (B,T,d), g (B,T,p), any strides; out (B,) float64).",
      py::arg("a").noconvert(), py::arg("g").noconvert(), py::arg("out").noconvert());
  m.def("conv2d_sq_norms", &conv2d_sq_norms, py::arg("x"), py::arg("g"), py::arg("shape"), py::arg("geometry"),
        py::arg("is_double"), py::arg("ghost"), py::arg("out"), py::arg("grads"), py::arg("bias_grads"),
        py::arg("weight"), py::arg("grad_input"),
        "out[i] = squared norm of sample i's 2-D convolution weight gradient (addresses of C-contiguous x (B,C,H,W) "
        "and g (B,C_out,OH,OW), both float32 or both float64; shape (B, C, H, W, C_out, OH, OW); geometry (groups, "
        "kh, kw, sh, sw, ph, pw, dh, dw); out float64 (B,)), by the ghost or the direct route; the direct route also "
        "writes the per-sample weight gradients to grads if not 0, each group's transposed: (B, groups, "
        "C_in/groups * kh * kw, C_out/groups); either route writes each sample's bias gradient to bias_grads "
        "(B, C_out) if not 0, and the input gradient (B, C, H, W) to grad_input if not 0, from weight "
        "(C_out, C/groups, kh, kw). Returns whether every norm is finite (a non-finite input value no output "
        "reads can make one NaN: use the composed routes then).");
  m.def("total_sq_norms", &total_sq_norms, py::arg("parts"), py::arg("batch"), py::arg("total"),
        "total[i] = sum over k of parts[k][i] (addresses of float64 (batch,) buffers, summed in order); returns "
        "whether all are finite.");
  m.def("clip_factors", &clip_factors, py::arg("total"), py::arg("batch"), py::arg("bound"), py::arg("scale"),
        py::arg("offset"), py::arg("clamp"), py::arg("out"),
        "out[i] = bound / (sqrt(total[i]) + offset / scale), capped at scale if clamp (addresses of float64 "
        "(batch,) buffers).");
  m.def("rows_sq_norms", &rows_sq_norms, py::arg("x"), py::arg("rows"), py::arg("cols"), py::arg("is_double"),
        py::arg("out"),
        "out[i] = sum_k x[i, k]^2 accumulated in float64 (address of a contiguous (rows, cols) float32 or float64 "
        "buffer; out: float64 (rows,)).");
  m.def("outer_sq_norms", &outer_sq_norms, py::arg("a"), py::arg("g"), py::arg("batch"), py::arg("d"), py::arg("p"),
        py::arg("is_double"), py::arg("weight"), py::arg("bias"),
        "weight[i] = |a_i|^2 |g_i|^2, bias[i] = |g_i|^2 in float64 (addresses of contiguous a (batch, d) and g "
        "(batch, p), both float32 or both float64; weight, bias: float64 (batch,)).");
  def_per_dtype(m, "group_norm_backward", &group_norm_backward_t<float>, &group_norm_backward_t<double>,
                "GroupNorm backward (x, dy (N,C,HW); mean, rstd (N,G); gamma (C) or None): writes dx (or skips it "
                "if None) and each sample's parameter gradients dgamma, dbeta (N,C).",
                py::arg("x").noconvert(), py::arg("dy").noconvert(), py::arg("mean").noconvert(),
                py::arg("rstd").noconvert(), py::arg("gamma").noconvert(), py::arg("groups"),
                py::arg("dx").noconvert(), py::arg("dgamma").noconvert(), py::arg("dbeta").noconvert());
}
