// The decoder layers of a Llama-family model, one call per forward (decoding/runtime/llama.py).
//
// Each layer computes what transformers' LlamaDecoderLayer computes through its modules, in the same
// order and dtypes (RMSNorm, rotary embedding, the linears as Int4Linear or nn.Linear compute them,
// the invariant attention, SiLU MLP, residual adds), so the result has the same bits; only the Python
// between the ops is gone, which at one row cost more than the arithmetic, and where one pass gives
// the values of several ops it takes their place: the cache writes and joined products' splits are
// plain copies and views, on the int8 kernel the norms and residual adds run inside the products that
// read and write them, and FixedSiLU's product reads gate and up in place.
#include <ATen/Parallel.h>

#include "kernels.h"

namespace {

// Whether a projection [codes, scale_min, bias] is on the int8 kernel: float32 scales and minimums, or a
// K-quant's compact factors (uint8); torch's int4 kernel takes bfloat16 ones.
bool on_int8(const at::Tensor* w) {
  return w[1].numel() > 0 && (w[1].scalar_type() == at::kFloat || w[1].scalar_type() == at::kByte);
}

// Int4Linear.forward / nn.Linear / RowsLinear (`rows_kernel`): [w, scales_zeros, bias] with scales_zeros
// empty for a dense weight; [codes, scale_min, bias] with float32 scale_min for int8 activations (in
// `levels` levels, a scale per `k_block` inputs on a K-quant).
at::Tensor linear(const at::Tensor& x, const at::Tensor* w, bool rows_kernel, int64_t levels, int64_t k_block) {
  if (w[1].numel() == 0 && rows_kernel) return rows_linear(x, w[0], w[2]);
  if (w[1].numel() == 0) return at::linear(x, w[0], w[2].numel() ? c10::optional<at::Tensor>(w[2]) : c10::nullopt);
  if (on_int8(w)) return q4_int8_linear(x, w[0], w[1], w[2], levels, k_block);
  const int64_t out_features = w[1].size(1);
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.reshape({-1, x.size(-1)}).to(at::kBFloat16), w[0], 32, w[1]);
  if (w[2].numel()) y = y + w[2];
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out_features);
  return y.reshape(shape);
}

// RowsRMSNorm.forward (csrc/norm.cpp) or LlamaRMSNorm.forward
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool rows_norm) {
  if (rows_norm) return rms_norm_rows(x, weight, eps);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor variance = xf.pow(2).mean(-1, true);
  return weight * (xf * at::rsqrt(variance + eps)).to(x.scalar_type());
}

// apply_rotary_pos_emb for one tensor, x [N, heads, D] and cos, sin [N, D], in one pass: per element
// the three rounded operations ATen runs (x * cos, rotate_half(x) * sin, their sum), each rounded to
// x's type T as ATen rounds it, so the bits are transformers' (five ATen ops and their buffers saved);
// the result then rounded once to O (attention's type: the copy attention.py makes of the queries).
template <typename T, typename O>
void rotate_rows(const T* x, int64_t x_stride, const T* cos, const T* sin, O* out, int64_t n, int64_t heads,
                 int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * x_stride + h * d;
        O* o = out + (t * heads + h) * d;
        for (int64_t i = 0; i < d; ++i) {
          const float rotated = i < half ? -static_cast<float>(xr[i + half]) : static_cast<float>(xr[i - half]);
          const T a = static_cast<T>(static_cast<float>(xr[i]) * static_cast<float>(cos[t * d + i]));
          const T b = static_cast<T>(rotated * static_cast<float>(sin[t * d + i]));  // -x is exact
          o[i] = static_cast<O>(static_cast<float>(static_cast<T>(static_cast<float>(a) + static_cast<float>(b))));
        }
      }
  });
}

// x [N, heads, D] (a view of a linear's output: its tokens may lie apart, a joined product's columns),
// cos and sin [N, 1, D]; the result is contiguous, in `out_type` (x's, or bfloat16 from float32).
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::ScalarType out_type) {
  const bool rows_apart = x.stride(2) == 1 && x.stride(1) == x.size(2);
  const at::Tensor xc = rows_apart ? x : x.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.scalar_type() == xc.scalar_type() && s.scalar_type() == xc.scalar_type() && c.numel() == xc.size(0) * xc.size(2),
              "rotate: cos and sin [N, 1, D] of x's type");
  const int64_t n = xc.size(0), heads = xc.size(1), d = xc.size(2);
  const auto type = xc.scalar_type();
  at::Tensor out = at::empty({n, heads, d}, xc.options().dtype(out_type));
  if (type == at::kBFloat16 && out_type == at::kBFloat16)
    rotate_rows(xc.data_ptr<at::BFloat16>(), xc.stride(0), c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(),
                out.data_ptr<at::BFloat16>(), n, heads, d);
  else if (type == at::kFloat && out_type == at::kFloat)
    rotate_rows(xc.data_ptr<float>(), xc.stride(0), c.data_ptr<float>(), s.data_ptr<float>(), out.data_ptr<float>(), n,
                heads, d);
  else if (type == at::kFloat && out_type == at::kBFloat16)
    rotate_rows(xc.data_ptr<float>(), xc.stride(0), c.data_ptr<float>(), s.data_ptr<float>(),
                out.data_ptr<at::BFloat16>(), n, heads, d);
  else {
    const int64_t h = d / 2;  // another type: ATen's ops
    return ((xc * c) + (at::cat({-xc.slice(-1, h), xc.slice(-1, 0, h)}, -1) * s)).to(out_type);
  }
  return out;
}

// cache[rows[n], :, slots[n]] = x[n] in the cache's type, for x [N, heads, D] (any strides) and a cache
// [R, heads, S, D] of any layout: RowKVCache.update's index_put_ for real tokens (the same values),
// without the indexing machinery that cost more than the copy at a token a row. Strides are read once:
// Tensor::stride(dim) in the inner loop cost more than the copy. Tokens are split across threads: with
// keys stored position-contiguous each element lands in its own cache line, a miss apiece.
template <typename C, typename X>
void put_typed(const at::Tensor& cache, const at::Tensor& x, const int64_t* rows, const int64_t* slots) {
  C* dst = cache.data_ptr<C>();
  const X* src = x.data_ptr<X>();
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2);
  const int64_t cr = cache.stride(0), ch = cache.stride(1), cs = cache.stride(2), cd = cache.stride(3);
  const int64_t xt = x.stride(0), xh = x.stride(1), xd = x.stride(2);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    // Misses overlap: every destination line of the range is requested (for writing) before the first
    // store, which otherwise waits in the store buffer behind the misses before it.
    if (cd != 1)
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const C* out = dst + rows[t] * cr + h * ch + slots[t] * cs;
          for (int64_t i = 0; i < d; ++i) __builtin_prefetch(out + i * cd, 1);
        }
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        C* out = dst + rows[t] * cr + h * ch + slots[t] * cs;
        const X* in = src + t * xt + h * xh;
        for (int64_t i = 0; i < d; ++i) out[i * cd] = static_cast<C>(static_cast<float>(in[i * xd]));
      }
  });
}

void put_rows(const at::Tensor& cache, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& slots) {
  TORCH_CHECK(cache.dim() == 4 && x.dim() == 3 && x.size(1) == cache.size(1) && x.size(2) == cache.size(3) &&
                  rows.numel() == x.size(0) && slots.numel() == x.size(0) && rows.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong && rows.is_contiguous() && slots.is_contiguous(),
              "put_rows: cache [R, heads, S, D], x [N, heads, D], rows and slots [N] int64");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(rp[t] >= 0 && rp[t] < cache.size(0) && sp[t] >= 0 && sp[t] < cache.size(2), "put_rows: (row ", rp[t],
                ", slot ", sp[t], ") outside the cache");
  const auto c = cache.scalar_type(), t = x.scalar_type();
  if (c == at::kFloat && t == at::kFloat) put_typed<float, float>(cache, x, rp, sp);
  else if (c == at::kBFloat16 && t == at::kBFloat16) put_typed<at::BFloat16, at::BFloat16>(cache, x, rp, sp);
  else if (c == at::kBFloat16 && t == at::kFloat) put_typed<at::BFloat16, float>(cache, x, rp, sp);
  else if (c == at::kFloat && t == at::kBFloat16) put_typed<float, at::BFloat16>(cache, x, rp, sp);
  else {  // another type: ATen's indexing
    c10::List<c10::optional<at::Tensor>> where({rows, c10::nullopt, slots});
    const_cast<at::Tensor&>(cache).index_put_(where, x.to(c));
  }
}

// The products of projections that read one input, rms_norm(h, norm): [w] alone each, or joined in the
// first's place (Layers.of: the others' codes empty) and split by columns, `sizes` per projection (-1:
// an equal share of the columns the given sizes leave); `views`: the split parts are views of the
// joined product, else contiguous copies. A product on the int8 kernel normalizes float32 rows itself
// (the norm's values, without its buffer); the others read the norm's output. `levels`: the int8
// kernel's activation levels for these projections (`k_block`: its inputs per scale on a K-quant).
std::vector<at::Tensor> products(const at::Tensor& h, const at::Tensor& norm, double eps, bool rows_norm,
                                 const at::Tensor* w, const std::vector<int64_t>& sizes, bool rows_kernel, bool views,
                                 int64_t levels, int64_t k_block) {
  at::Tensor normed;  // rms_norm(h, norm), made where a product reads it
  auto product = [&](const at::Tensor* wj) {
    if (rows_norm && on_int8(wj) && h.scalar_type() == at::kFloat)
      return q4_int8_fused(h, wj[0], wj[1], wj[2], levels, k_block, norm, eps, at::Tensor());
    if (!normed.defined()) normed = rms_norm(h, norm, eps, rows_norm);
    return linear(normed, wj, rows_kernel, levels, k_block);
  };
  std::vector<at::Tensor> out;
  if (w[3].numel() > 0) {
    for (size_t j = 0; j < sizes.size(); ++j) out.push_back(product(w + 3 * j));
    return out;
  }
  const at::Tensor joined = product(w);
  int64_t given = 0, shares = 0;
  for (int64_t n : sizes) n < 0 ? ++shares : given += n;
  const int64_t share = shares ? (joined.size(-1) - given) / shares : 0;
  int64_t start = 0;
  for (int64_t n : sizes) {
    n = n < 0 ? share : n;
    const at::Tensor part = joined.narrow(-1, start, n);
    out.push_back(views ? part : part.contiguous());
    start += n;
  }
  TORCH_CHECK(start == joined.size(-1), "decoder_layers: joined projections of ", joined.size(-1), " columns");
  return out;
}

// h + x W^T, the residual add: on the int8 kernel in its output loop (the same rounding, no buffer).
at::Tensor add_linear(const at::Tensor& h, const at::Tensor& x, const at::Tensor* w, bool rows_kernel,
                      int64_t k_block) {
  if (on_int8(w) && h.scalar_type() == at::kFloat && h.is_contiguous())
    return q4_int8_fused(x, w[0], w[1], w[2], 1, k_block, at::Tensor(), 0.0, h);
  return h + linear(x, w, rows_kernel, 1, k_block);
}

}  // namespace

std::vector<at::Tensor> decoder_layers(at::Tensor h, const std::vector<at::Tensor>& weights, double eps,
                                       int64_t head_dim, double scaling, const at::Tensor& cos,
                                       const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                                       const std::vector<at::Tensor>& values, const at::Tensor& rows,
                                       const at::Tensor& slots, int64_t kv_len, const at::Tensor& mask,
                                       const at::Tensor& kv_rows, const at::Tensor& share, const at::Tensor& tables,
                                       int64_t capture, const at::Tensor& real, bool rows_kernel,
                                       bool rows_norm, bool fixed_silu, int64_t qkv_levels,
                                       const std::vector<int64_t>& k_blocks) {
  constexpr size_t PER_LAYER = 2 + 7 * 3;  // two norm weights, then q, k, v, o, gate, up, down
  constexpr size_t INPUTS = 4;             // a layer's inputs: q, k and v's; o's; gate and up's; down's
  TORCH_CHECK(weights.size() == keys.size() * PER_LAYER && keys.size() == values.size(), "decoder_layers: weights");
  TORCH_CHECK(k_blocks.size() == keys.size() * INPUTS, "decoder_layers: k_blocks, ", INPUTS, " a layer");
  const int64_t batch = h.size(0), n_new = h.size(1);
  // Ragged: only the `real` tokens of the [B, T] layout (flat indices, not its pads) go through the
  // norms, linears and cache writes, as [N, H]; attention alone sees the [B, T] layout. Each row
  // of a linear is computed alone (quant.py's invariance), so a real token's bits do not change.
  const bool ragged = real.numel() > 0;
  // Without pads (`real` is sorted) the [N, H] and [B, T] layouts hold the same tokens in the same order.
  const bool padded = ragged && real.numel() < batch * n_new;
  // The real tokens' slots, so that attention skips the pads' queries (empty: every slot is real).
  const at::Tensor live = padded ? at::zeros({batch * n_new}, real.options().dtype(at::kBool)).index_fill_(0, real, true)
                                 : at::empty({0}, real.options().dtype(at::kBool));
  // cos and sin come as [B, 1, T, D]: per token [B * T, 1, D] (the same values, one row a token)
  at::Tensor cos_t = cos.reshape({batch * n_new, 1, head_dim}), sin_t = sin.reshape({batch * n_new, 1, head_dim});
  c10::List<c10::optional<at::Tensor>> where({rows, c10::nullopt, slots});
  at::Tensor real_rows, real_slots;  // ragged: each real token's cache row and slot
  if (ragged) {
    h = h.reshape({batch * n_new, -1});
    real_rows = rows.expand({batch, n_new}).reshape({-1});
    real_slots = slots.reshape({-1});
    if (padded) {
      h = h.index_select(0, real);
      cos_t = cos_t.index_select(0, real);
      sin_t = sin_t.index_select(0, real);
      real_rows = real_rows.index_select(0, real);
      real_slots = real_slots.index_select(0, real);
    }
    real_rows = real_rows.contiguous();
    real_slots = real_slots.contiguous();
  }
  at::Tensor hidden;
  for (size_t i = 0; i < keys.size(); ++i) {
    const at::Tensor* w = weights.data() + i * PER_LAYER;
    const int64_t* k_block = k_blocks.data() + i * INPUTS;  // each input's inputs per scale on a K-quant
    // k's and v's columns: kv heads x head_dim each; q's the rest
    const int64_t kv = keys[i].size(1) * head_dim;
    // q, k and v as views of a joined product (read in place by rotate and put_rows)
    const std::vector<at::Tensor> qkv = products(h, w[0], eps, rows_norm, w + 2, {-1, kv, kv}, rows_kernel, true, qkv_levels,
                                                     k_block[0]);
    at::Tensor q, k, v;
    if (ragged) {  // [N, heads, D]
      const std::vector<int64_t> shape{h.size(0), -1, head_dim};
      q = rotate(qkv[0].view(shape), cos_t, sin_t, keys[i].scalar_type());  // in attention's type
      k = rotate(qkv[1].view(shape), cos_t, sin_t, qkv[1].scalar_type());
      v = qkv[2].view(shape);
      put_rows(keys[i], k, real_rows, real_slots);
      put_rows(values[i], v, real_rows, real_slots);
      // Pad queries see only their own (unwritten) slot; their outputs are dropped below.
      if (padded) q = at::zeros({batch * n_new, q.size(1), head_dim}, q.options()).index_copy_(0, real, q);
      q = q.view({batch, n_new, -1, head_dim}).transpose(1, 2);
    } else {  // rotated as [B * T, heads, D], then [B, heads, T, D]
      const std::vector<int64_t> flat{batch * n_new, -1, head_dim}, shape{batch, n_new, -1, head_dim};
      q = rotate(qkv[0].view(flat), cos_t, sin_t, keys[i].scalar_type()).view(shape).transpose(1, 2);
      k = rotate(qkv[1].view(flat), cos_t, sin_t, qkv[1].scalar_type()).view(shape).transpose(1, 2);
      v = qkv[2].view(shape).transpose(1, 2);
      // RowKVCache.update, in place: this forward's slots of each row, then every row up to kv_len.
      keys[i].index_put_(where, k.transpose(1, 2).to(keys[i].scalar_type()));
      values[i].index_put_(where, v.transpose(1, 2).to(values[i].scalar_type()));
    }
    // in the cache's type, as attention.py's invariant_attention; a paged cache's pools whole, read
    // through the rows' block tables
    const bool paged = tables.numel() > 0;
    at::Tensor out = attend(q.to(keys[i].scalar_type()), paged ? keys[i] : keys[i].slice(2, 0, kv_len),
                            paged ? values[i] : values[i].slice(2, 0, kv_len), mask, kv_rows, scaling, live, share,
                            tables, paged ? kv_len : -1)
                         .to(h.scalar_type());
    out = !ragged ? out.reshape({batch, n_new, -1})
          : padded ? out.reshape({batch * n_new, -1}).index_select(0, real)
                   : out.reshape({batch * n_new, -1});
    h = add_linear(h, out, w + 11, rows_kernel, k_block[1]);
    // torch's SiLU: gate and up contiguous, as the separate modules return them, so that its vector loop
    // and tail split them the same way; FixedSiLU's bits do not depend on the split: read in place.
    const std::vector<at::Tensor> gate_up = products(h, w[1], eps, rows_norm, w + 14, {-1, -1}, rows_kernel, fixed_silu, 1,
                                                         k_block[2]);
    const at::Tensor act = fixed_silu ? silu_mul(gate_up[0], gate_up[1]) : at::silu(gate_up[0]) * gate_up[1];
    h = add_linear(h, act, w + 20, rows_kernel, k_block[3]);
    if (static_cast<int64_t>(i) == capture) hidden = h;
  }
  return {h, hidden.defined() ? hidden : at::Tensor()};
}
