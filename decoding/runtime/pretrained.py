"""The runtime's models as `transformers` types them, for the type checker.

The runtime takes a model as a `torch.nn.Module` (what it replaces and walks are modules), yet every
model it loads is a `transformers` causal LM, whose own methods (`get_output_embeddings`,
`set_attn_implementation`, ...) torch's `Module` does not declare. `pretrained` names that type; it
changes nothing at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:  # importing transformers costs seconds; its types are read by the checker alone
    from transformers import PreTrainedModel


def pretrained(model: torch.nn.Module) -> PreTrainedModel:
    """`model` as the `transformers` model it is (the runtime loads no other)."""
    return cast("PreTrainedModel", model)


def decoder(model: torch.nn.Module) -> Any:
    """A causal LM's decoder (`model.model`: embed_tokens, rotary_emb, layers, norm). Its submodules
    are `transformers`' per-architecture classes, whose attributes torch's stub types as a tensor or a
    module: the runtime reads them as the architecture declares them (architectures/)."""
    return model.model
