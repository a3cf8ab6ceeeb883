// The decoder layers of a Llama-family model, one call per forward (decoding/core/llama.py).
//
// Each layer runs the ATen ops that transformers' LlamaDecoderLayer runs through its modules, in
// the same order and dtypes (RMSNorm in float32, rotary embedding, the linears as Int4Linear or
// nn.Linear compute them, the invariant attention, SiLU MLP, residual adds), so the result has the
// same bits; only the Python between the ops is gone, which at one row cost more than the
// arithmetic.
#include "kernels.h"

namespace {

// Int4Linear.forward / nn.Linear / RowsLinear (`rows_kernel`): [w, scales_zeros, bias] with scales_zeros
// empty for a dense weight; [codes, scale_min, bias] with float32 scale_min for int8 activations.
at::Tensor linear(const at::Tensor& x, const at::Tensor* w, bool rows_kernel) {
  if (w[1].numel() == 0 && rows_kernel) return rows_linear(x, w[0], w[2]);
  if (w[1].numel() == 0) return at::linear(x, w[0], w[2].numel() ? c10::optional<at::Tensor>(w[2]) : c10::nullopt);
  if (w[1].scalar_type() == at::kFloat) return q4_int8_linear(x, w[0], w[1], w[2]);
  const int64_t out_features = w[1].size(1);
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.reshape({-1, x.size(-1)}).to(at::kBFloat16), w[0], 32, w[1]);
  if (w[2].numel()) y = y + w[2];
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out_features);
  return y.reshape(shape);
}

// LlamaRMSNorm.forward
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor variance = xf.pow(2).mean(-1, true);
  return weight * (xf * at::rsqrt(variance + eps)).to(x.scalar_type());
}

// apply_rotary_pos_emb for one tensor (rotate_half inlined)
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return (x * cos) + (at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1) * sin);
}

}  // namespace

std::vector<at::Tensor> decoder_layers(at::Tensor h, const std::vector<at::Tensor>& weights, double eps,
                                       int64_t head_dim, double scaling, const at::Tensor& cos,
                                       const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                                       const std::vector<at::Tensor>& values, const at::Tensor& rows,
                                       const at::Tensor& slots, int64_t kv_len, const at::Tensor& mask,
                                       const at::Tensor& kv_rows, int64_t capture, const at::Tensor& real, bool rows_kernel) {
  constexpr size_t PER_LAYER = 2 + 7 * 3;  // two norm weights, then q, k, v, o, gate, up, down
  TORCH_CHECK(weights.size() == keys.size() * PER_LAYER && keys.size() == values.size(), "decoder_layers: weights");
  const int64_t batch = h.size(0), n_new = h.size(1);
  // Ragged: only the `real` tokens of the [B, T] layout (flat indices, not its pads) go through the
  // norms, linears and cache writes, as [N, H]; attention alone sees the [B, T] layout. Each row
  // of a linear is computed alone (quant.py's invariance), so a real token's bits do not change.
  const bool ragged = real.numel() > 0;
  // The real tokens' slots, so that attention skips the pads' queries (empty: every slot is real).
  const at::Tensor live = ragged ? at::zeros({batch * n_new}, real.options().dtype(at::kBool)).index_fill_(0, real, true)
                                 : at::empty({0}, real.options().dtype(at::kBool));
  at::Tensor cos_t = cos, sin_t = sin;
  c10::List<c10::optional<at::Tensor>> where({rows, c10::nullopt, slots});
  if (ragged) {
    h = h.reshape({batch * n_new, -1}).index_select(0, real);
    cos_t = cos.reshape({batch * n_new, 1, head_dim}).index_select(0, real);
    sin_t = sin.reshape({batch * n_new, 1, head_dim}).index_select(0, real);
    const at::Tensor flat_rows = rows.expand({batch, n_new}).reshape({-1}).index_select(0, real);
    where = c10::List<c10::optional<at::Tensor>>({flat_rows, c10::nullopt, slots.reshape({-1}).index_select(0, real)});
  }
  at::Tensor hidden;
  for (size_t i = 0; i < keys.size(); ++i) {
    const at::Tensor* w = weights.data() + i * PER_LAYER;
    const at::Tensor x = rms_norm(h, w[0], eps);
    at::Tensor q, k, v;
    if (ragged) {  // [N, heads, D]
      const std::vector<int64_t> shape{x.size(0), -1, head_dim};
      q = rotate(linear(x, w + 2, rows_kernel).view(shape), cos_t, sin_t);
      k = rotate(linear(x, w + 5, rows_kernel).view(shape), cos_t, sin_t);
      v = linear(x, w + 8, rows_kernel).view(shape);
      keys[i].index_put_(where, k.to(keys[i].scalar_type()));
      values[i].index_put_(where, v.to(values[i].scalar_type()));
      // Pad queries see only their own (unwritten) slot; their outputs are dropped below.
      q = at::zeros({batch * n_new, q.size(1), head_dim}, q.options()).index_copy_(0, real, q);
      q = q.view({batch, n_new, -1, head_dim}).transpose(1, 2);
    } else {
      const std::vector<int64_t> shape{batch, n_new, -1, head_dim};
      q = rotate(linear(x, w + 2, rows_kernel).view(shape).transpose(1, 2), cos, sin);
      k = rotate(linear(x, w + 5, rows_kernel).view(shape).transpose(1, 2), cos, sin);
      v = linear(x, w + 8, rows_kernel).view(shape).transpose(1, 2);
      // RowKVCache.update, in place: this forward's slots of each row, then every row up to kv_len.
      keys[i].index_put_(where, k.transpose(1, 2).to(keys[i].scalar_type()));
      values[i].index_put_(where, v.transpose(1, 2).to(values[i].scalar_type()));
    }
    at::Tensor out = attend(q, keys[i].slice(2, 0, kv_len), values[i].slice(2, 0, kv_len), mask, kv_rows, scaling, live);
    out = ragged ? out.reshape({batch * n_new, -1}).index_select(0, real) : out.reshape({batch, n_new, -1});
    h = h + linear(out, w + 11, rows_kernel);
    const at::Tensor y = rms_norm(h, w[1], eps);
    h = h + linear(at::silu(linear(y, w + 14, rows_kernel)) * linear(y, w + 17, rows_kernel), w + 20, rows_kernel);
    if (static_cast<int64_t>(i) == capture) hidden = h;
  }
  return {h, hidden.defined() ? hidden : at::Tensor()};
}
