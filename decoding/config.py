"""Which decoder to run and with what options, read from the config and checked at load time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from decoding.aded import AdedOptions
from decoding.draft_model import SpecOptions
from decoding.errors import ConfigError
from decoding.models import ModelSpec
from decoding.pld import PLDOptions
from decoding.recycling import RecyclingOptions
from decoding.seed import SeedOptions
from decoding.stand import StandOptions

DECODERS = ("hf", "ar", "sd", "seed", "pld", "recycling", "stand", "seed_stand", "aded")
# Decoders that draft with a model (`draft.path`).
MODEL_DRAFTING = ("sd", "seed")


@dataclass(frozen=True)
class DecoderConfig:
    name: str = "ar"
    spec: SpecOptions = field(default_factory=SpecOptions)
    seed: SeedOptions = field(default_factory=SeedOptions)
    stand: StandOptions = field(default_factory=StandOptions)
    pld: PLDOptions = field(default_factory=PLDOptions)
    recycling: RecyclingOptions = field(default_factory=RecyclingOptions)
    aded: AdedOptions = field(default_factory=AdedOptions)
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
        if name in MODEL_DRAFTING or name == "seed_stand":
            own = own if name in MODEL_DRAFTING else (c.get("seed") or {})
            name_for_spec = name if name in MODEL_DRAFTING else "seed"
            k_config = own.get("k_config", list(spec.k_config))
            if not isinstance(k_config, (list, tuple)):
                raise ConfigError(f"{name_for_spec}.k_config={k_config!r} must be a list such as [2,2,1]")
            spec = SpecOptions(
                k_config=tuple(k_config),
                multi_candidate=_bool(
                    f"{name_for_spec}.multi_candidate", own.get("multi_candidate", spec.multi_candidate)
                ),
                without_replacement=_bool(
                    f"{name_for_spec}.without_replacement", own.get("without_replacement", spec.without_replacement)
                ),
                **_tree_policy_options(name_for_spec, own, spec),
                key=name_for_spec,
            )
        seed = SeedOptions()
        if name in ("seed", "seed_stand"):
            own_seed = c.get("seed") or {}
            verify_batch = as_int("seed.verify_batch", own_seed.get("verify_batch", seed.verify_batch))
            if verify_batch < 1:
                raise ConfigError(
                    f"seed.verify_batch={verify_batch} must be a positive integer (1: the paper's schedule)"
                )
            seed = SeedOptions(verify_batch, _bool("seed.overlap", own_seed.get("overlap", seed.overlap)))
        stand = StandOptions()
        if name in ("stand", "seed_stand", "recycling"):
            st = c.get("stand") or {}
            stand = StandOptions(
                tree=str(st.get("tree", stand.tree)),
                scope=st.get("scope", stand.scope),
                seed_prompt=_bool("stand.seed_prompt", st.get("seed_prompt", stand.seed_prompt)),
                stochastic=_bool("stand.stochastic", st.get("stochastic", stand.stochastic)),
                capacity=as_int("stand.capacity", st.get("capacity", stand.capacity)),
                max_pools=as_int("stand.max_pools", st.get("max_pools", stand.max_pools)),
                min_path_prob=as_float("stand.min_path_prob", st.get("min_path_prob", stand.min_path_prob)),
            )
        pld = PLDOptions()
        if name == "pld":
            pc = c.get("pld") or {}
            pld = PLDOptions(
                as_int("pld.max_ngram", pc.get("max_ngram", pld.max_ngram)),
                as_int("pld.num_draft", pc.get("num_draft", pld.num_draft)),
            )
        recycling = RecyclingOptions()
        if name == "recycling":
            recycling = RecyclingOptions(as_int("recycling.top_k", (c.get("recycling") or {}).get("top_k", 8)))
        aded = AdedOptions.from_dict(c.get("aded") or {}) if name == "aded" else AdedOptions()
        draft_cfg = c.get("draft") or {}
        draft = None
        if draft_cfg.get("path") not in (None, ""):
            known = {"path", "device", "dtype", "cache_dir"}
            vocab = draft_cfg.get("vocab")
            draft = ModelSpec(
                **{k: str(v) for k, v in draft_cfg.items() if k in known and v is not None},
                key="draft",
                vocab=None if vocab is None else as_int("draft.vocab", vocab),
            )
        return cls(
            name=name,
            spec=spec,
            seed=seed,
            stand=stand,
            pld=pld,
            recycling=recycling,
            aded=aded,
            # seed_stand drafts with a model too when one is configured (the union of both trees).
            draft=draft if name in MODEL_DRAFTING or name == "seed_stand" else None,
        )


def _tree_policy_options(key: str, own: dict[str, Any], spec: SpecOptions) -> dict[str, Any]:
    """`<key>.tree_policy` and its options (decoding/tree_policy.py); SpecOptions checks the combinations."""
    tree, ratio = own.get("tree"), own.get("pct_ratio")
    return {
        "tree_policy": str(own.get("tree_policy", spec.tree_policy)),
        "tree": None if tree in (None, "") else str(tree),
        "pct_top_k": as_int(f"{key}.pct_top_k", own.get("pct_top_k", spec.pct_top_k)),
        "pct_max_depth": as_int(f"{key}.pct_max_depth", own.get("pct_max_depth", spec.pct_max_depth)),
        "pct_threshold": as_float(f"{key}.pct_threshold", own.get("pct_threshold", spec.pct_threshold)),
        "pct_ratio": None if ratio is None else as_float(f"{key}.pct_ratio", ratio),
    }


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
