"""The forward of a Llama-family model (architectures.py: Llama, Qwen2) over a RowKVCache: the ops
`transformers` runs, without its plumbing.

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

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, cast

import torch

from decoding.runtime import architectures, attention, kernels
from decoding.runtime.activation import FixedSiLU
from decoding.runtime.kv_cache import ForwardView
from decoding.runtime.norm import RowsRMSNorm
from decoding.runtime.pretrained import decoder, pretrained
from decoding.runtime.quant import GROUP, Int4Linear, Q8Linear, takes_int8
from decoding.runtime.rows_linear import RowsLinear

_NONE = torch.empty(0)
PROJECTIONS: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SAME_INPUT = ((0, 1, 2), (3,), (4, 5), (6,))  # projections of one input: q, k, v; o; gate, up; down


def readers(layer: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """A decoder layer's projections by the input they read (SAME_INPUT): q, k, v; o; gate, up; down."""
    return [[layer.get_submodule(PROJECTIONS[i]) for i in group] for group in SAME_INPUT]


def _joined(projections: list[torch.nn.Module]) -> list[torch.Tensor] | None:
    """Projections of one input on the int8 kernel as one product (q, k and v; gate and up): their
    weights side by side, the modules' own buffers then views of them (no second copy). A column's
    bits do not depend on the columns beside it (csrc/q4_int8.cpp), so each keeps its module's bits;
    one call quantizes the input once. None where they are not all on that kernel."""
    if len(projections) < 2 or any(not takes_int8(p, alone=True) for p in projections):
        return None
    int8 = cast(list[Int4Linear | Q8Linear], projections)  # what takes_int8(alone=True) holds of each
    if len({type(p) for p in int8}) != 1:  # 4-bit and Q8 codes are packed apart
        return None
    same: tuple[Callable[[Int4Linear | Q8Linear], Hashable], ...] = (
        lambda p: p.bias is None,
        lambda p: p.in_features,
        _levels,
        lambda p: (p.factors.dtype, p.factors.dim()),
    )
    if any(len({f(p) for p in int8}) != 1 for f in same):  # one input, one format of factors
        return None
    packed = torch.cat([p.packed8 for p in int8])
    factors = torch.cat([p.factors for p in int8])
    biases = [p.bias for p in int8]
    bias = _NONE if biases[0] is None else torch.cat([b for b in biases if b is not None])  # (all have one: `same`)
    start = 0
    for p in int8:
        n = p.packed8.shape[0]
        p.packed8, p.factors = packed[start : start + n], factors[start : start + n]
        start += n
    return [packed, factors, bias]


def _levels(projection: torch.nn.Module) -> int:
    """The int8 levels a projection quantizes its input in (1 for every other kind)."""
    return cast(Int4Linear | Q8Linear, projection).levels if takes_int8(projection, alone=True) else 1


@dataclass(frozen=True)
class Layers:
    """A Llama model's decoder-layer weights as csrc/layers.cpp reads them: per layer the two norm
    weights, then per projection [weight or int4 codes, int4 scales/zeros or empty, bias or empty]
    (q, k, v and gate, up on the int8 kernel: the first's place holds them joined, the rest empty)."""

    model: torch.nn.Module  # a causal LM of an architectures.ARCHITECTURES entry
    weights: list[torch.Tensor]
    eps: float
    head_dim: int
    scaling: float
    rows: bool  # the dense projections are RowsLinear (the row-invariant kernel), not nn.Linear
    rows_norm: bool  # the norms are RowsRMSNorm (csrc/norm.cpp), not LlamaRMSNorm
    fixed_silu: bool  # the MLPs' act_fn is FixedSiLU (csrc/activation.cpp), not torch's SiLU
    qkv_levels: int  # int8 levels of q, k and v's input (quant.py two_level_inputs); the others' is 1
    # per layer and input (q, k and v's; o's; gate and up's; down's): inputs per activation scale where the
    # int8 layers' factors are a K-quant's (quant.use_k_block)
    k_blocks: tuple[int, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Layers | None:
        """The layers, or None where this path would not compute the model's own forward: not a
        causal LM of the architecture table, another attention than the invariant one, another activation or norm (or
        FixedSiLU in some layers only), or
        a projection that is neither `nn.Linear`, `RowsLinear` nor `Int4Linear` (e.g. float32's
        PrepackedLinear), dense projections of both kinds, norms of both kinds, or int8 levels other
        than one for q, k and v (as `qkv_levels`) and one for the rest, or projections of one input with two
        `k_block`s."""
        arch = architectures.of(model)
        if arch is None or pretrained(model).config._attn_implementation != attention.NAME:
            return None
        if pretrained(model).config.hidden_act != "silu" or not decoder(model).layers:
            return None
        weights: list[torch.Tensor] = []
        dense: set[type] = set()
        layers = decoder(model).layers
        norms = {type(m) for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)}
        if len(norms) != 1 or not norms <= {arch.rms_norm, RowsRMSNorm}:
            return None
        silus = {type(layer.mlp.act_fn) is FixedSiLU for layer in layers}
        if len(silus) != 1:
            return None
        # (untyped: checked against it, the layer would be typed as the torch Module it declares)
        decoder_layer: Any = arch.decoder_layer
        for layer in layers:
            if type(layer) is not decoder_layer:
                return None
            weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            projections: list[Any] = [layer.get_submodule(name) for name in PROJECTIONS]
            for group in SAME_INPUT:
                joined = _joined([projections[i] for i in group])
                if joined is not None:  # the first one's place holds them all, the others' are empty
                    weights += joined + [_NONE] * 3 * (len(group) - 1)
                    continue
                for proj in (projections[i] for i in group):
                    if type(proj) in (Int4Linear, Q8Linear):
                        weights += list(proj.weights())
                    elif type(proj) in (torch.nn.Linear, RowsLinear):
                        weights += [proj.weight, _NONE]
                        dense.add(type(proj))
                    else:
                        return None
                    weights.append(_NONE if proj.bias is None else proj.bias)
        if len(dense) > 1:
            return None
        levels = [{_levels(layer.get_submodule(name)) for layer in layers} for name in PROJECTIONS]
        qkv_levels = levels[0] | levels[1] | levels[2]
        if len(qkv_levels) != 1 or any(s != {1} for s in levels[3:]):
            return None
        k_blocks: list[int] = []
        for layer in layers:
            for inputs in readers(layer):
                blocks = {cast(Int4Linear | Q8Linear, p).k_block for p in inputs if takes_int8(p, alone=True)}
                if len(blocks) > 1:
                    return None
                k_blocks.append(blocks.pop() if blocks else GROUP)
        first = layers[0]
        eps = {layer.input_layernorm.variance_epsilon for layer in layers}
        if len(eps) != 1 or eps != {layer.post_attention_layernorm.variance_epsilon for layer in layers}:
            return None
        scaling = float(first.self_attn.scaling)
        head_dim, rows = first.self_attn.head_dim, RowsLinear in dense
        norm_rows, silu, qkv = RowsRMSNorm in norms, silus.pop(), qkv_levels.pop()
        return cls(model, weights, float(eps.pop()), head_dim, scaling, rows, norm_rows, silu, qkv, tuple(k_blocks))

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
        model: Any = self.model  # a causal LM of the architecture table: its submodules are transformers' own
        inner = model.model
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
            _NONE if cache.share is None else cache.share,
            _NONE if cache.tables is None else cache.tables,
            -1 if capture is None else capture,
            _NONE if real is None else real,
            self.rows,
            self.rows_norm,
            self.fixed_silu,
            self.qkv_levels,
            self.k_blocks,
        )
        h = inner.norm(h)
        if logits_at is not None:
            h = h[logits_at] if real is not None else h[:, logits_at]
        return model.lm_head(h), (hidden if capture is not None else None)


def forward_path(model: torch.nn.Module) -> str:
    """Which forward computes the model, for the load log: the project's layers, or transformers' own
    and why (a model of no architecture plug-in says which ones there are)."""
    arch = architectures.of(model)
    if arch is None:
        return f"transformers' forward: {type(model).__name__} is of no architecture plug-in ({architectures.names()})"
    if Layers.of(model) is None:
        return f"transformers' forward ({arch.name}: its attention, activation or projections are not the layers')"
    return f"the project's layers ({arch.name})"
