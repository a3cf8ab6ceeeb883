"""`python -m decoding.sampler_cost`: what sampling one token costs, per sampler (Hydra).

Takes the target's real logits at every position of a prompt (one forward of the loaded model) and
times, per position, the samplers a decoder may use for the target's own token: the Gumbel-max
sampler with public noise (verify.rule=match_gumbel, decoding/speculation/gumbel.py), and the processed
softmax with one torch.multinomial draw (match_multinomial, `transformers`' sampling). Prints the
median milliseconds per token at each temperature and their ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from decoding.base.cli import fail, hydra_command
from decoding.base.errors import BackendError, ConfigError
from decoding.base.options import as_int
from decoding.base.prompts import render
from decoding.base.values import check_sampling
from decoding.runtime.models import load_model
from decoding.runtime.spec import ModelSpec
from decoding.speculation.gumbel import gumbel_choice
from decoding.speculation.sampling import SamplingParams, make_generator, process_logits


@dataclass(frozen=True)
class SamplerCostConfig:
    model: ModelSpec
    prompt: str
    temperatures: tuple[float, ...]
    top_k: int
    top_p: float
    repeats: int

    def __post_init__(self) -> None:
        if not self.temperatures or any(t <= 0 for t in self.temperatures):
            raise ConfigError(
                f"temperatures={list(self.temperatures)} must be positive (temperature 0 samples nothing)"
            )
        # The request's own rules (GenRequest), each error naming the key.
        sampling = {f"temperatures[{i}]": ("temperature", t) for i, t in enumerate(self.temperatures)}
        check_sampling({**sampling, "top_k": ("top_k", self.top_k), "top_p": ("top_p", self.top_p)})
        if self.repeats < 1:
            raise ConfigError(f"repeats={self.repeats} must be positive")

    @classmethod
    def from_omegaconf(cls, cfg: DictConfig) -> SamplerCostConfig:
        c = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's is a dict
        temps = c["temperatures"]
        if not isinstance(temps, list):
            raise ConfigError(f"temperatures={temps!r} must be a list such as [0.6,1.0]")
        return cls(
            model=ModelSpec.from_config(c["model"]),
            prompt=str(c["prompt"]),
            temperatures=tuple(float(t) for t in temps),
            top_k=as_int("top_k", c["top_k"]),
            top_p=float(c["top_p"]),
            repeats=as_int("repeats", c["repeats"]),
        )


def per_token_ms(logits: torch.Tensor, params: SamplingParams, repeats: int) -> dict[str, float]:
    """Median ms per token of each sampler over the rows of `logits` [N, V]."""
    gen = make_generator(0)

    def multinomial(row: torch.Tensor, pos: int) -> int:
        return int(torch.multinomial(process_logits(row[None], [params])[0], 1, generator=gen))

    def gumbel(row: torch.Tensor, pos: int) -> int:
        return gumbel_choice(row, params, 0, pos)

    out = {}
    for name, sample in (("match_gumbel", gumbel), ("match_multinomial", multinomial)):
        times = []
        for _ in range(repeats):
            for pos, row in enumerate(logits):
                t0 = time.perf_counter()
                sample(row, pos)
                times.append(1000 * (time.perf_counter() - t0))
        out[name] = statistics.median(times)
    return out


@hydra_command("sampler_cost", groups=("model",))
def main(cfg: DictConfig) -> None:
    try:
        scfg = SamplerCostConfig.from_omegaconf(cfg)
        loaded = load_model(scfg.model)
    except (ConfigError, BackendError) as e:
        fail(str(e).splitlines()[0])
    ids = render(loaded.tokenizer, loaded.use_chat_template, scfg.prompt).ids
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([ids], device=loaded.device)).logits[0].float()
    print(
        f"sampler cost per token, {loaded.source} on {loaded.device} ({torch.get_num_threads()} threads), "
        f"the target's logits at the prompt's {len(ids)} positions (vocabulary {logits.shape[-1]}), "
        f"top_k {scfg.top_k}, top_p {scfg.top_p}, median of {scfg.repeats} passes"
    )
    print("| temperature | match_gumbel ms | match_multinomial ms | gumbel / multinomial |")
    print("|---|---|---|---|")
    for t in scfg.temperatures:
        ms = per_token_ms(logits, SamplingParams(t, scfg.top_k, scfg.top_p), scfg.repeats)
        ratio = ms["match_gumbel"] / ms["match_multinomial"]
        print(f"| {t} | {ms['match_gumbel']:.3f} | {ms['match_multinomial']:.3f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
