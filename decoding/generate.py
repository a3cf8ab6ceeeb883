"""`python -m decoding.generate prompts=PATH out=PATH`: completions for a JSONL of prompts (Hydra).

Input rows: {"id": ..., "prompt": "...", "n": 1}; `n` samples of one prompt are the trajectories of
one group, decoded together. Output rows, appended as each batch of prompts finishes:
{"id", "sample", "text", "token_ids", "finish_reason", "stats"}; a rerun with the same `out`
skips the prompts already there. A summary of the decode statistics goes to `<out>.summary.json`.
"""

from __future__ import annotations

import functools
import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue
from tqdm import tqdm

from decoding.api.config import DecoderConfig
from decoding.base.cli import Refused, fail, hydra_command
from decoding.base.errors import BackendError, ConfigError
from decoding.base.options import as_float, as_int
from decoding.base.values import MAX_TOP_LOGPROBS, DecodeStats, GenRequest, Group, check_sampling, host_line
from decoding.runtime.collector import collector_off
from decoding.runtime.spec import ModelSpec

if TYPE_CHECKING:  # the runtime (torch, transformers: seconds) loads once the options hold
    from decoding.api.engine import Engine


@dataclass(frozen=True)
class PromptRow:
    id: str
    prompt: str
    n: int
    choices: tuple[str, ...] = ()  # answers to score after the prompt in place of generating


@dataclass(frozen=True)
class GenerateConfig:
    prompts: Path
    out: Path
    decoder: DecoderConfig
    model: ModelSpec
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    batch_size: int
    seed: int
    gpu_profile: bool = False
    warmup: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        check_sampling(
            {
                "gen.temperature": ("temperature", self.temperature),
                "gen.top_p": ("top_p", self.top_p),
                "gen.top_k": ("top_k", self.top_k),
                "gen.max_new_tokens": ("max_new_tokens", self.max_new_tokens),
            }
        )
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} must be a positive integer")
        if not isinstance(self.gpu_profile, bool):
            raise ConfigError(f"gpu_profile={self.gpu_profile!r} must be true or false")
        if not isinstance(self.warmup, bool):
            raise ConfigError(f"warmup={self.warmup!r} must be true or false")
        if not isinstance(self.logprobs, bool):
            raise ConfigError(f"gen.logprobs={self.logprobs!r} must be true or false")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS or (self.top_logprobs and not self.logprobs):
            raise ConfigError(
                f"gen.top_logprobs={self.top_logprobs} must be in 0..{MAX_TOP_LOGPROBS}, with gen.logprobs=true"
            )

    @classmethod
    def from_omegaconf(cls, cfg: DictConfig) -> GenerateConfig:
        try:
            # A DictConfig's container is a dict.
            c = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
        except MissingMandatoryValue as e:
            key = e.full_key
            raise ConfigError(f"{key} is required: python -m decoding.generate prompts=PATH out=PATH") from None
        gen = c["gen"]
        return cls(
            prompts=Path(str(c["prompts"])),
            out=Path(str(c["out"])),
            model=ModelSpec.from_config(c["model"]),
            temperature=as_float("gen.temperature", gen["temperature"]),
            top_p=as_float("gen.top_p", gen["top_p"]),
            top_k=as_int("gen.top_k", gen["top_k"]),
            max_new_tokens=as_int("gen.max_new_tokens", gen["max_new_tokens"]),
            batch_size=as_int("batch_size", c["batch_size"]),
            seed=as_int("gen.seed", gen["seed"]),
            gpu_profile=c.get("gpu_profile", False),
            warmup=c.get("warmup", False),
            logprobs=gen.get("logprobs", False),
            top_logprobs=as_int("gen.top_logprobs", gen.get("top_logprobs", 0)),
            decoder=DecoderConfig.from_container(c),  # last: it loads the drafters' modules (torch, seconds)
        )


def read_prompts(path: Path) -> list[PromptRow]:
    if not path.is_file():
        raise ConfigError(f"prompts={path} does not exist; give a JSONL file of {{'id', 'prompt'}} rows")
    rows: list[PromptRow] = []
    seen: set[str] = set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} is not valid JSON ({e.msg}); each line must be one JSON object") from None
        if not isinstance(rec, dict) or "id" not in rec or not isinstance(rec.get("prompt"), str) or not rec["prompt"]:
            raise ConfigError(f'{where} needs an "id" and a non-empty "prompt" string')
        n = rec.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f'{where} has "n": {n!r}; n is the number of samples, a positive integer')
        pid = str(rec["id"])
        if pid in seen:
            raise ConfigError(f'{where} repeats "id": {pid!r}; ids must be unique')
        seen.add(pid)
        choices = rec.get("choices", [])
        if not isinstance(choices, list) or not all(isinstance(a, str) and a for a in choices):
            raise ConfigError(f'{where} has "choices": {choices!r}; give a list of non-empty answer strings')
        rows.append(PromptRow(pid, rec["prompt"], n, tuple(choices)))
    return rows


def done_ids(out: Path) -> set[str]:
    """Prompts whose completions are all in `out`. Lines of a prompt only partly written (and a
    line cut short) by a kill are dropped, so that prompt is simply completed again."""
    if not out.exists():
        return set()
    raw = out.read_text(encoding="utf-8")
    lines: dict[str, list[str]] = {}
    for line in raw.splitlines(keepends=True):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if line.endswith("\n") and isinstance(rec, dict) and "id" in rec:
            lines.setdefault(str(rec["id"]), []).append(line)
    done = {pid for pid, ls in lines.items() if len(ls) == json.loads(ls[0]).get("n", 1)}
    good = "".join(line for pid in done for line in lines[pid])
    if good != raw:
        out.write_text(good, encoding="utf-8")
    return done


def request_seed(seed: int, pid: str, sample: int) -> int:
    return zlib.crc32(f"{seed}/{pid}/{sample}".encode())


def generate(cfg: GenerateConfig, engine: Engine, progress: bool = True) -> dict[str, Any]:
    """Complete every prompt not yet in cfg.out, appending as each batch finishes; returns the summary."""
    from decoding.runtime.time_split import gpu_busy

    rows = read_prompts(cfg.prompts)
    done = done_ids(cfg.out)
    todo = [r for r in rows if r.id not in done]
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    stats = DecodeStats()
    kernel_s = 0.0  # with gpu_profile: time the GPU ran kernels
    t0 = time.perf_counter()
    completions = 0
    if cfg.warmup and todo:
        # One untimed call of the first batch: CUDA's lazy start-up, graph capture, the planner's profile.
        engine.generate(_requests(cfg, todo[: cfg.batch_size]))
        t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc=f"generate/{cfg.decoder.name}", unit="prompt", disable=not progress)
    for start in range(0, len(todo), cfg.batch_size):
        batch = todo[start : start + cfg.batch_size]
        requests = _requests(cfg, batch)
        if cfg.gpu_profile and engine.loaded.device.type == "cuda":
            done_requests, busy = gpu_busy(functools.partial(engine.generate, requests))
            kernel_s += busy * engine.last_stats.wall_s
        else:
            done_requests = engine.generate(requests)
        results = iter(done_requests)
        stats += engine.last_stats
        with cfg.out.open("a", encoding="utf-8") as f:
            for r in batch:
                for k in range(r.n):
                    res = next(results)
                    record = {
                        "id": r.id,
                        "sample": k,
                        "n": r.n,
                        "text": res.text,
                        "token_ids": res.token_ids,
                        "finish_reason": res.finish_reason,
                        "stats": res.stats.to_dict(),
                    }
                    if res.logprobs is not None:
                        record["logprobs"] = [t.to_dict() for t in res.logprobs]
                    if res.choice_logprobs is not None:
                        record["choice_logprobs"] = dict(zip(r.choices, res.choice_logprobs))
                    f.write(json.dumps(record) + "\n")
                    completions += 1
            f.flush()
        bar.update(len(batch))
    bar.close()
    summary = {
        "decoder": cfg.decoder.name,
        "model": cfg.model.path,
        "prompts": len(todo),
        "skipped_done": len(rows) - len(todo),
        "completions": completions,
        "wall_s": time.perf_counter() - t0,
        "tokens_per_s": stats.generated_tokens / stats.wall_s if stats.wall_s else 0.0,
        **stats.to_dict(),
        **stats.schedule.host_summary(),
    }
    if stats.target_forwards:
        summary["ms_per_forward"] = 1000 * stats.wall_s / stats.target_forwards
    graphs = engine.target.static
    if graphs is not None:
        summary["graphs"] = {"capture": graphs.spec.capture, **vars(graphs.stats)}
    if cfg.gpu_profile and engine.loaded.device.type == "cuda":
        summary["gpu_busy_share"] = kernel_s / stats.wall_s if stats.wall_s else 0.0
    summary_path = cfg.out.with_name(cfg.out.name + ".summary.json")
    summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def _requests(cfg: GenerateConfig, batch: list[PromptRow]) -> list[GenRequest]:
    return [
        GenRequest(
            r.prompt,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            group=Group(r.id),
            seed=request_seed(cfg.seed, r.id, k),
            logprobs=cfg.logprobs,
            top_logprobs=cfg.top_logprobs,
            choices=r.choices,
        )
        for r in batch
        for k in range(r.n)
    ]


def summary_line(s: dict[str, Any]) -> str:
    return (
        f"decoder={s['decoder']}: {s['completions']} completions ({s['skipped_done']} prompts already done), "
        f"{s['generated_tokens']} tokens in {s['wall_s']:.1f}s = {s['tokens_per_s']:.1f} tok/s, "
        f"acceptance length {s['acceptance_length']:.2f}, {s['forwards_per_token']:.3f} target forwards/token, "
        f"{s['rows_per_forward']:.2f} rows/forward"
        + (f", {s['ms_per_forward']:.2f} ms per target forward" if "ms_per_forward" in s else "")
        + (f", {host_line(s)}" if s.get("steps") else "")
        + (f", GPU busy {100 * s['gpu_busy_share']:.0f}% of the wall time" if "gpu_busy_share" in s else "")
    )


def check_options(cfg: DictConfig, run_dir: Path) -> None:
    """The options and the prompts checked before Hydra starts and the runtime loads (torch and
    transformers: seconds), so a bad value stops in about a second."""
    try:
        read_prompts(GenerateConfig.from_omegaconf(cfg).prompts)
    except (ConfigError, BackendError) as e:
        raise Refused(str(e).splitlines()[0]) from None


@hydra_command("generate", groups=("decoder", "model"), before=check_options)
def main(cfg: DictConfig) -> None:
    try:
        gcfg = GenerateConfig.from_omegaconf(cfg)
        read_prompts(gcfg.prompts)  # bad input fails before a model is loaded
        from decoding.api.engine import Engine
        from decoding.drafters.load import load_draft
        from decoding.runtime.models import load_model

        target = load_model(gcfg.model)
        draft = load_draft(gcfg.decoder.draft, target) if gcfg.decoder.draft else None
        with collector_off():  # the loaded model's objects out of the collector's full passes
            summary = generate(gcfg, Engine(target, gcfg.decoder, draft))
    except (ConfigError, BackendError) as e:
        fail(str(e).splitlines()[0])
    print(summary_line(summary))


if __name__ == "__main__":
    main()
