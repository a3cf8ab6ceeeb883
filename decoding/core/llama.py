"""The forward of a Llama-family model over a RowKVCache: the ops `transformers` runs, without its plumbing.

At one row the embedded model's int4 weights take about 3 ms per forward to read, yet a forward
through `transformers` took 13 ms on the 2-core machine: the Python around some 2,000 small ops per
forward (module calls, keyword plumbing, mask and cache dispatch) cost more than the arithmetic.
Here the decoder layers run in one C++ call (csrc/layers.cpp) that issues the same ATen ops in the
same order and dtypes as `LlamaDecoderLayer` with its `Int4Linear` / `nn.Linear` projections, and
the invariant attention (dense projections through csrc/matmul.cpp where they are `RowsLinear`);
embedding, rotary tables, final norm and LM head stay the model's own modules. Every logit has the
bits the `transformers` forward of the same loaded model computes (tests/test_llama.py checks it), so
`hf`'s `generate` stays the reference for every decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM

from decoding.core import attention, kernels
from decoding.core.kv_cache import ForwardView
from decoding.core.quant import Int4Linear
from decoding.core.rows_linear import RowsLinear

_NONE = torch.empty(0)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Layers:
    """A Llama model's decoder-layer weights as csrc/layers.cpp reads them: per layer the two norm
    weights, then per projection [weight or int4 codes, int4 scales/zeros or empty, bias or empty]."""

    model: LlamaForCausalLM
    weights: list[torch.Tensor]
    eps: float
    head_dim: int
    scaling: float
    rows: bool  # the dense projections are RowsLinear (the row-invariant kernel), not nn.Linear

    @classmethod
    def of(cls, model: torch.nn.Module) -> Layers | None:
        """The layers, or None where this path would not compute the model's own forward: not a
        Llama causal LM, another attention than the invariant one, another activation or norm, or
        a projection that is neither `nn.Linear`, `RowsLinear` nor `Int4Linear` (e.g. float32's
        PrepackedLinear), or dense projections of both kinds."""
        if type(model) is not LlamaForCausalLM or model.config._attn_implementation != attention.NAME:
            return None
        if model.config.hidden_act != "silu" or not model.model.layers:
            return None
        weights: list[torch.Tensor] = []
        dense: set[type] = set()
        for layer in model.model.layers:
            if type(layer) is not LlamaDecoderLayer:
                return None
            weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for name in PROJECTIONS:
                proj = layer.get_submodule(name)
                if type(proj) is Int4Linear:
                    weights += list(proj.weights())
                elif type(proj) in (torch.nn.Linear, RowsLinear):
                    weights += [proj.weight, _NONE]
                    dense.add(type(proj))
                else:
                    return None
                weights.append(_NONE if proj.bias is None else proj.bias)
        if len(dense) > 1:
            return None
        first = model.model.layers[0]
        eps = {layer.input_layernorm.variance_epsilon for layer in model.model.layers}
        if len(eps) != 1 or eps != {layer.post_attention_layernorm.variance_epsilon for layer in model.model.layers}:
            return None
        scaling = float(first.self_attn.scaling)
        return cls(model, weights, float(eps.pop()), first.self_attn.head_dim, scaling, RowsLinear in dense)

    @torch.inference_mode()
    def forward(
        self,
        cache: ForwardView,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        kv_rows: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        capture: int | None = None,
        real: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for new tokens [B, T] (at `logits_at` only, if given), and the output of decoder
        layer `capture` (or None). `cache` is this forward's view of the cache, its rows read in place;
        `mask` is its boolean [B, 1, T, L] visibility; `kv_rows` names the cache rows of the token
        rows when they are a subset. `real` (flat indices into [B, T]): only those tokens are
        computed (pads skipped), logits are [K, V] at `logits_at` indices into them."""
        inner = self.model.model
        h = inner.embed_tokens(tokens)
        cos, sin = inner.rotary_emb(h, positions)
        rows, slots = cache.write_index()
        h, hidden = kernels.load().decoder_layers(
            h,
            self.weights,
            self.eps,
            self.head_dim,
            self.scaling,
            cos.unsqueeze(1),
            sin.unsqueeze(1),
            cache.keys,
            cache.values,
            rows,
            slots,
            cache.kv_len,
            mask,
            _NONE if kv_rows is None else kv_rows,
            -1 if capture is None else capture,
            _NONE if real is None else real,
            self.rows,
        )
        h = inner.norm(h)
        if logits_at is not None:
            h = h[logits_at] if real is not None else h[:, logits_at]
        return self.model.lm_head(h), (hidden if capture is not None else None)
