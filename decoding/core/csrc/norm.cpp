// RMSNorm in one pass per row (decoding/core/norm.py's RowsRMSNorm, which both the model's modules and
// csrc/layers.cpp run): what LlamaRMSNorm computes, in eight ATen ops and their buffers, in one.
//     r = 1 / sqrt(sum(x^2) / H + eps),  y = T(weight * T(x * r))   (T: x's type; sums in float)
// The squares are summed in 8 lanes (element i into lane i mod 8) in order, the lanes then added in a
// fixed tree: a row's bits do not depend on the rows beside it or on threads.
#include <ATen/Parallel.h>

#include "kernels.h"

#include <cmath>

namespace {

template <typename T>
void norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* xr = x + m * h;
      float lanes[8] = {};
      int64_t i = 0;
      for (; i + 8 <= h; i += 8)
        for (int64_t l = 0; l < 8; ++l) {
          const float v = static_cast<float>(xr[i + l]);
          lanes[l] += v * v;
        }
      float tail = 0.0f;
      for (; i < h; ++i) tail += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float sum = (((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))) + tail;
      const float r = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
      T* o = out + m * h;
      for (int64_t j = 0; j < h; ++j)
        o[j] = static_cast<T>(static_cast<float>(w[j]) * static_cast<float>(static_cast<T>(static_cast<float>(xr[j]) * r)));
    }
  });
}

}  // namespace

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm_rows: weight [H] of x's type");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t h = x.size(-1), rows = h ? xc.numel() / h : 0;
  if (x.scalar_type() == at::kBFloat16)
    norm_rows(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, h,
              static_cast<float>(eps));
  else if (x.scalar_type() == at::kFloat)
    norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), rows, h, static_cast<float>(eps));
  else
    TORCH_CHECK(false, "rms_norm_rows: bfloat16 or float32, not ", x.scalar_type());
  return out;
}
