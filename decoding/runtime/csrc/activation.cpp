// SiLU with a fixed exp (kernels.h's fixed_silu) for models whose act_fn is decoding/runtime/activation.py's
// FixedSiLU: that module (what `hf` runs) and csrc/layers.cpp compute it here, so both have one set of
// bits. ATen's own SiLU takes a vector exp in its loop and a scalar one in the loop's tail, so an
// element's bits depend on where the tail falls; here every element is computed alike, which lets
// the C++ layers read gate and up in place in a joined product and multiply in the same pass.
#include <ATen/Parallel.h>

#include "kernels.h"

namespace {

constexpr int64_t GRAIN = 16384;  // elements a task at least: one token's rows run inline

void silu_span(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fixed_silu(x[i]);
}

void silu_mul_span(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fixed_silu(g[i]) * u[i];
}

}  // namespace

at::Tensor silu_fixed(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_fixed: float32, not ", x.scalar_type());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float* in = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, xc.numel(), GRAIN, [&](int64_t begin, int64_t end) { silu_span(in + begin, o + begin, end - begin); });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.sizes() == up.sizes() &&
                  gate.stride(-1) == 1 && up.stride(-1) == 1,
              "silu_mul: float32 gate and up of one shape, each row contiguous");
  const int64_t n = gate.size(-1), rows = n ? gate.numel() / n : 0;
  const at::Tensor g = gate.reshape({rows, n}), u = up.reshape({rows, n});  // views where rows lie evenly apart
  at::Tensor out = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, GRAIN / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      silu_mul_span(g.data_ptr<float>() + m * g.stride(0), u.data_ptr<float>() + m * u.stride(0), o + m * n, n);
  });
  return out;
}
