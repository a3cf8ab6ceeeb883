"""Which decoder to run and with what options, read from the config and checked at load time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from decoding.draft_model import SpecOptions
from decoding.errors import ConfigError
from decoding.models import ModelSpec
from decoding.seed import SeedOptions

DECODERS = ("hf", "ar", "sd", "seed")
# Decoders that draft with a model (`draft.path`).
MODEL_DRAFTING = ("sd", "seed")


@dataclass(frozen=True)
class DecoderConfig:
    name: str = "ar"
    spec: SpecOptions = field(default_factory=SpecOptions)
    seed: SeedOptions = field(default_factory=SeedOptions)
    draft: ModelSpec | None = None  # path "self" drafts with the target itself

    def __post_init__(self) -> None:
        if self.name not in DECODERS:
            raise ConfigError(f"decoder={self.name} is not one of {', '.join(DECODERS)}")
        if self.name in MODEL_DRAFTING and self.draft is None:
            raise ConfigError(
                f"decoder={self.name} drafts with a draft model: set draft.path=<Hugging Face id or directory "
                "sharing the target's tokenizer>, or draft.path=self to measure the machinery alone"
            )

    @classmethod
    def from_container(cls, c: dict[str, Any]) -> DecoderConfig:
        """From a resolved config: `decoder.name`, the decoder's own namespace (`sd: {...}`) and `draft`."""
        name = str(c["decoder"]["name"])
        own = c.get(name) or {}
        spec = SpecOptions()
        if name in MODEL_DRAFTING:
            k_config = own.get("k_config", list(spec.k_config))
            if not isinstance(k_config, (list, tuple)):
                raise ConfigError(f"{name}.k_config={k_config!r} must be a list such as [2,2,1]")
            spec = SpecOptions(
                k_config=tuple(k_config),
                multi_candidate=_bool(f"{name}.multi_candidate", own.get("multi_candidate", spec.multi_candidate)),
                without_replacement=_bool(
                    f"{name}.without_replacement", own.get("without_replacement", spec.without_replacement)
                ),
                key=name,
            )
        seed = SeedOptions()
        if name == "seed":
            verify_batch = as_int("seed.verify_batch", own.get("verify_batch", seed.verify_batch))
            if verify_batch < 1:
                raise ConfigError(
                    f"seed.verify_batch={verify_batch} must be a positive integer (1: the paper's schedule)"
                )
            seed = SeedOptions(verify_batch, _bool("seed.overlap", own.get("overlap", seed.overlap)))
        draft_cfg = c.get("draft") or {}
        draft = None
        if draft_cfg.get("path") not in (None, ""):
            known = {"path", "device", "dtype", "cache_dir"}
            draft = ModelSpec(**{k: str(v) for k, v in draft_cfg.items() if k in known and v is not None}, key="draft")
        return cls(name=name, spec=spec, seed=seed, draft=draft if name in MODEL_DRAFTING else None)


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")
    return value


def as_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} is not an integer")
    return value


def as_float(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} is not a number")
    return float(value)
