"""Loading the draft model of the model-drafting decoders (`draft.path`)."""

from __future__ import annotations

from decoding.base.errors import BackendError
from decoding.edd.model import load_edd
from decoding.runtime.models import LoadedModel, load_model
from decoding.runtime.spec import ModelSpec


def load_draft(spec: ModelSpec, target: LoadedModel) -> LoadedModel:
    """The draft model for speculative decoders; `self` drafts with the target model itself, `edd`
    with the EDD trained for it."""
    if spec.path == "self":
        return target
    if spec.path == "edd":  # the EDD draft decoder trained for this target (python -m tuning.train_edd)
        return load_edd(spec, target)
    draft = load_model(spec)
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise BackendError(
            f"{spec.key}.path={spec.path} does not share the target's tokenizer ({target.source}); a draft model "
            "must come from the target's family (same vocabulary), or use draft.path=self"
        )
    return draft
