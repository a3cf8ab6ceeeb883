"""Batch- and tree-invariant attention on the CPU, as a `transformers` attention implementation.

`csrc/attention.cpp` computes each query's output from that query and the keys/values it sees, in
position order, with a fixed reduction order (see its header): scored alone, beside other rows or
inside a draft tree, a token gets the same bits. Together with linear kernels that are invariant to
the number of rows (bfloat16 and int4 weights on this CPU, see decoding/runtime/quant.py) this makes the
decoders lossless by construction. The kernel reads the KV cache in place: no float mask over the
longest row, no gather of the verified rows.

Its kernel is compiled on first use (decoding/runtime/kernels.py).
"""

from __future__ import annotations

import torch

from decoding.base.errors import BackendError
from decoding.runtime import kernels
from decoding.runtime.quant import INT8_CACHE, takes_int8
from decoding.runtime.spec import INVARIANT_ATTENTION

CHOICE = INVARIANT_ATTENTION  # the model.attention value (decoding/runtime/spec.py)
NAME = "tot_invariant"  # the `attn_implementation` name models are switched to
_EMPTY = torch.empty(0)


def invariant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kv_rows: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The `transformers` attention interface: query [B, H, T, D], key/value [B', H_kv, L, D] (B' > B
    when `kv_rows` picks the cache rows of the query rows), a boolean mask [B, 1, T, L] (True:
    visible) or None for causal. Returns [B, T, H, D] in the query's type; the attention runs in the
    keys' type, or in quant.INT8_CACHE where the layer's projections take int8 activations (the
    decoders' cache is then of that type; `transformers`' own cache, which `hf` uses, is not)."""
    if module.training and dropout:
        raise BackendError("the invariant attention is for inference; use model.attention=sdpa to train")
    mask = _EMPTY if attention_mask is None else attention_mask
    if mask.numel() and mask.dtype != torch.bool:
        mask = mask == 0  # an additive float mask: 0 where visible
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    rows = _EMPTY if kv_rows is None else kv_rows
    dtype = INT8_CACHE if takes_int8(module) else key.dtype
    q, k, v = (t.to(dtype) for t in (query, key, value))
    out = kernels.load().attend(
        q, k, v, mask, rows, float(scale), _EMPTY, _EMPTY, _EMPTY, -1
    )  # (no pads, shares, pages)
    return out.to(query.dtype), None


def register() -> None:
    """Make NAME a valid `attn_implementation` (its masks are boolean, as for sdpa)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, invariant_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
