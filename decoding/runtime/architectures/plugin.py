"""What an architecture declares (`PLUGIN = ArchitecturePlugin(...)` ends each module of this folder)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from decoding.base.plugins import Plugin


@dataclass(frozen=True, kw_only=True)
class ArchitecturePlugin(Plugin):
    """A causal LM family by its `transformers` module classes; `build` is its causal LM class."""

    KIND: ClassVar[str] = "architecture"

    decoder_layer: type[torch.nn.Module]
    rms_norm: type[torch.nn.Module]
    mlp: type[torch.nn.Module]

    @property
    def causal_lm(self) -> type[torch.nn.Module]:
        return cast(type[torch.nn.Module], self.build)  # (an architecture declares its class as `build`)
