"""The `verify:` section: how much one verification forward scores and under which acceptance rule,
for every speculative decoder (read by the schedules, and by drafters that order by the rule's noise)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from decoding.base.errors import ConfigError

if TYPE_CHECKING:  # not at import: a command checks its options before it loads torch
    import torch

# How the target's token at temperature > 0 is decided (verify.rule; decoding/speculation/verify.py):
# match_gumbel: Gumbel-max with the request's public noise (decoding/speculation/gumbel.py), a draft kept
# when it is that sample; match_multinomial: the same with `transformers`' torch.multinomial
# stream; rejection: speculative sampling's rules (decoding/speculation/acceptance.py).
Rule = Literal["match_gumbel", "match_multinomial", "rejection"]
RULES: tuple[Rule, ...] = ("match_gumbel", "match_multinomial", "rejection")

# verify.plan=fixed, verify.max_tokens=auto on a CPU: the old fixed cut, 16 tree tokens per forward
# (where trees stopped paying on the machine it was measured on, docs/performance.md); no cap on a GPU.
CPU_MAX_TOKENS = 16
PLANS = ("auto", "goodput", "fixed")
# Where the matched rules walk a verified tree (verify.walk; decoding/speculation/device_walk.py).
WALKS = ("auto", "host", "device")


@dataclass(frozen=True)
class VerifyOptions:
    """The `verify:` section: how much one verification forward scores, for every speculative decoder."""

    # goodput: each step planned for the most expected committed tokens per second (the step
    # planner, decoding/schedules/planner.py); fixed: every tree cut to max_tokens / rows - 1 nodes;
    # auto: fixed for `seed` (SEED's Algorithm 1 baseline), goodput for every other decoder.
    plan: str = "auto"
    max_tokens: int | str | None = "auto"  # plan=fixed: tree tokens (roots included) per forward
    # At temperature > 0 (decoding/speculation/sampling.py, Rule): match_gumbel, the target samples each
    # position by Gumbel-max with the request's public noise and a drafted token is kept when it is
    # that sample; drafters that know the noise propose it. match_multinomial: the same with
    # torch.multinomial's stream (`transformers`' own sampling). Under either, outputs are `hf`'s
    # very samples under that sampler, whatever was drafted and ran at once. rejection: speculative
    # sampling's rules (draft_tree.multi_candidate, without_replacement): distributed as the target, not
    # `hf`'s samples.
    rule: Rule = "match_gumbel"
    cost: str | None = None  # plan=goodput: a forward-cost profile JSON (null: profiled on this machine, cached)
    # Where the matched rules' tree walk runs: device, as tensor operations where the logits are with one
    # read-back a step; host, node by node, sampling only the nodes a walk reaches; auto: device off the
    # CPU, host on it. The same paths and tokens either way.
    walk: str = "auto"

    def __post_init__(self) -> None:
        if self.plan not in PLANS:
            raise ConfigError(f"verify.plan={self.plan!r} is not one of {', '.join(PLANS)}")
        ok = self.max_tokens in (None, "auto") or (
            isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens > 0
        )
        if not ok:
            raise ConfigError(
                f"verify.max_tokens={self.max_tokens!r} must be a positive number of tokens, auto or null (no cap)"
            )
        if self.rule not in RULES:
            raise ConfigError(f"verify.rule={self.rule!r} is not one of {', '.join(RULES)}")
        if self.walk not in WALKS:
            raise ConfigError(f"verify.walk={self.walk!r} is not one of {', '.join(WALKS)}")
        if self.cost is not None and not Path(self.cost).is_file():
            raise ConfigError(
                f"verify.cost={self.cost!r} is not a file: give a profile JSON "
                "(python -m decoding.profile_forward out=...) or null to profile this machine"
            )

    @property
    def coupled(self) -> bool:
        """Drafters propose the target's own samples: they order candidates by its public noise."""
        return self.rule == "match_gumbel"

    @property
    def walk_on_device(self) -> bool | None:
        """`accept`'s walk_on_device: None where auto decides by the logits' device."""
        return None if self.walk == "auto" else self.walk == "device"

    def for_decoder(self, name: str) -> VerifyOptions:
        """plan=auto resolved for decoder `name`."""
        if self.plan != "auto":
            return self
        return replace(self, plan="fixed" if name == "seed" else "goodput")

    def budget(self, device: torch.device) -> int | None:
        """plan=fixed: tree tokens (roots included) one forward may score, or None for no cap."""
        if self.max_tokens == "auto":
            return CPU_MAX_TOKENS if device.type == "cpu" else None
        return self.max_tokens  # type: ignore[return-value]
