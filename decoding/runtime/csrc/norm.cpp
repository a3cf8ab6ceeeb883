// RMSNorm in one pass per row (decoding/runtime/norm.py's RowsRMSNorm, which both the model's modules and
// csrc/layers.cpp run): what LlamaRMSNorm computes, in eight ATen ops and their buffers, in one
// (kernels.h's norm_row): a row's bits do not depend on the rows beside it or on threads.
#include <ATen/Parallel.h>

#include "kernels.h"

namespace {

template <typename T>
void norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) norm_row(x + m * h, w, out + m * h, h, eps);
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
