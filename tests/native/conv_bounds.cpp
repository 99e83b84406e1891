// Memory-safety check of the fused convolution norms (csrc/linear_norms.cpp) under
// AddressSanitizer and UBSan: `make native-bounds` builds and runs it. Every buffer is
// allocated to its exact size, so a read past the input, the output gradient or the
// scratch (the kernel's vector loads of g may run past a row, masked) is reported.
// Values are checked by the Python tests; here only that every norm is finite and that the
// input gradient (whose vector gathers read shifted rows) matches a direct loop.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "linear_norms.h"

using fastdp::Conv2dGeometry;

template <typename F>
bool run(int64_t batch, int64_t channels, int64_t height, int64_t width, int64_t out_channels, int64_t groups,
         int64_t kernel, int64_t stride, int64_t pad, int64_t dilation) {
  Conv2dGeometry c{batch, channels, height, width, out_channels, 0, 0, groups, kernel, kernel, stride, stride,
                   pad, pad, dilation, dilation};
  c.out_height = (height + 2 * pad - dilation * (kernel - 1) - 1) / stride + 1;
  c.out_width = (width + 2 * pad - dilation * (kernel - 1) - 1) / stride + 1;
  if (c.out_height <= 0 || c.out_width <= 0) return true;
  std::mt19937 rng(7);
  std::normal_distribution<double> normal;
  std::vector<F> x(batch * channels * height * width), g(batch * out_channels * c.out_height * c.out_width);
  for (auto& v : x) v = static_cast<F>(normal(rng));
  for (auto& v : g) v = static_cast<F>(normal(rng));
  std::vector<double> out(batch);
  const int64_t cin = channels / groups, p = out_channels / groups;
  std::vector<F> grads(batch * out_channels * cin * kernel * kernel), bias(batch * out_channels);
  std::vector<F> weight(out_channels * cin * kernel * kernel), dx(x.size());
  for (auto& v : weight) v = static_cast<F>(normal(rng));
  // dx[i, ch, iy, ix] = sum over taps and outputs reading it of weight * g
  std::vector<double> expected(x.size(), 0.0);
  for (int64_t i = 0; i < batch; ++i)
    for (int64_t o = 0; o < out_channels; ++o)
      for (int64_t oy = 0; oy < c.out_height; ++oy)
        for (int64_t ox = 0; ox < c.out_width; ++ox)
          for (int64_t ch = 0; ch < cin; ++ch)
            for (int64_t ki = 0; ki < kernel; ++ki)
              for (int64_t kj = 0; kj < kernel; ++kj) {
                const int64_t iy = oy * stride - pad + ki * dilation, ix = ox * stride - pad + kj * dilation;
                if (iy < 0 || iy >= height || ix < 0 || ix >= width) continue;
                const int64_t channel = o / p * cin + ch;
                expected[((i * channels + channel) * height + iy) * width + ix] +=
                    double(weight[((o * cin + ch) * kernel + ki) * kernel + kj]) *
                    g[((i * out_channels + o) * c.out_height + oy) * c.out_width + ox];
              }
  const double tolerance = sizeof(F) == 4 ? 1e-4 : 1e-12;
  bool ok = true;
  for (bool ghost : {false, true}) {
    fastdp::conv2d_sq_norms<F>(x.data(), g.data(), c, ghost, out.data(), ghost ? nullptr : grads.data(),
                               bias.data(), weight.data(), dx.data());
    for (double v : out) ok = ok && std::isfinite(v);
    for (size_t k = 0; k < dx.size(); ++k)
      ok = ok && std::abs(dx[k] - expected[k]) <= tolerance * (1 + std::abs(expected[k]));
  }
  fastdp::conv2d_sq_norms<F>(x.data(), g.data(), c, false, out.data(), nullptr, nullptr, nullptr, nullptr);
  for (double v : out) ok = ok && std::isfinite(v);
  return ok;
}

int main() {
  int cases = 0, failed = 0;
  for (int64_t size : {1, 2, 3, 5, 17, 20})
    for (int64_t kernel : {1, 2, 3})
      for (int64_t stride : {1, 2, 3})
        for (int64_t pad : {0, 2, 5})
          for (int64_t per_group : {1, 7, 17, 33})
            for (int64_t groups : {1, 2}) {
              failed += !run<float>(1, 2 * groups, size, size + 3, per_group * groups, groups, kernel, stride, pad, 1);
              failed += !run<double>(2, groups, size, size, per_group * groups, groups, kernel, stride, pad, 2);
              cases += 2;
            }
  std::printf("native-bounds: %d convolution cases, %d with a non-finite norm or a wrong input gradient\n", cases,
              failed);
  return failed ? 1 : 0;
}
