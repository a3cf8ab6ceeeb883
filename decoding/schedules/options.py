"""The `seed:` section's options, apart from the rounds that read them (rounds.py): checking a
config imports neither torch nor the schedules."""

from __future__ import annotations

from dataclasses import dataclass

from decoding.base.errors import ConfigError


@dataclass(frozen=True)
class RoundsOptions:
    """The `seed:` section, SEED's rounds (section 4 and Algorithm 1) as `seed` and `seed_stand` run
    them: how many queued drafts one forward verifies, and whether drafting runs in a thread beside
    the verifier, as SEED's parallel draft processes do."""

    verify_batch: int = 8  # queued drafts verified per target forward (1: the paper's schedule)
    overlap: bool = False  # draft in a thread while the target verifies

    def __post_init__(self) -> None:
        if isinstance(self.verify_batch, bool) or not isinstance(self.verify_batch, int) or self.verify_batch < 1:
            raise ConfigError(
                f"seed.verify_batch={self.verify_batch} must be a positive integer (1: the paper's schedule)"
            )
