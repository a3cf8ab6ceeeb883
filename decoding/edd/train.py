"""Training the EDD draft decoder (decoding/edd/model.py) from a corpus of the target's own texts.

`python -m tuning.train_edd` builds the corpus (ToT rollouts decoded by the target) and calls this:
2. Features: for each text (its last `train.seq_len` tokens) the target's hidden states after layer
   `edd.layer` (the soft prompt) and its final hidden states (the LM head of which gives the target's
   distribution, for the KL), cached to <work_dir>/features-<hash>.pt.
3. Training (paper section 3.1): the EDD reads [H; T] under the dual-block mask with a block length
   drawn uniformly from [train.min_block, train.max_block] each step, and minimises KL(P_target ||
   P_edd) at every token; AdamW, warmup then cosine decay; a held-out split of the problems gives the
   held-out KL (and top-1 agreement with the target) every `train.eval_every` steps; a checkpoint
   every `train.checkpoint_every` steps, resumed on a rerun.
4. The trained EDD goes to `out`, with the corpus's tokens ranked by frequency (draft.vocab).
"""

from __future__ import annotations

import math
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from decoding.base.errors import ConfigError
from decoding.edd.model import EddConfig, EddModel, dual_block_mask, kl_to_target, save_edd
from decoding.runtime.models import LoadedModel
from decoding.runtime.pretrained import pretrained
from decoding.runtime.runner import decoder_layers
from decoding.runtime.spec import ModelSpec

DISTINCT_TAIL = 32  # texts whose windows agree but for the last this many tokens are kept once


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int = 128
    batch_size: int = 4
    steps: int = 250
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup: int = 20
    min_block: int = 2
    max_block: int = 8
    eval_block: int = 4
    eval_every: int = 50
    checkpoint_every: int = 50
    heldout: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("seq_len", "batch_size", "steps", "min_block", "max_block", "eval_block", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be a positive integer")
        if self.checkpoint_every < 1:
            raise ConfigError(f"train.checkpoint_every={self.checkpoint_every} must be a positive integer")
        if self.min_block > self.max_block:
            raise ConfigError(
                f"train.min_block={self.min_block} exceeds train.max_block={self.max_block}; block lengths "
                "are drawn from [min_block, max_block]"
            )
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr} must be positive")
        if not 0 < self.heldout < 1:
            raise ConfigError(f"train.heldout={self.heldout} must be a fraction in (0, 1) of the problems")


class TrainingRun(Protocol):
    """What training reads of a run's configuration (tuning.train_edd's TrainConfig)."""

    model: ModelSpec
    layer: int
    init_layer: int | None
    train: TrainSettings
    out: Path
    work_dir: Path

    def features_key(self) -> str: ...

    def run_key(self) -> str: ...


# --- 2. features --------------------------------------------------------------------------------


@dataclass
class Example:
    group: str  # the problem it came from (the held-out split is by problem)
    ids: torch.Tensor  # [n]
    hidden: torch.Tensor  # [n, H] the soft prompt (float16)
    final: torch.Tensor  # [n, H] the target's final hidden states, before its LM head (float16)


@torch.inference_mode()
def target_features(model: torch.nn.Module, layer: int, ids: list[list[int]]) -> list[tuple[torch.Tensor, ...]]:
    """(hidden after `layer`, final normed hidden) of each token sequence, batched with right padding."""
    device = next(model.parameters()).device
    width = max(len(x) for x in ids)
    tokens = torch.zeros(len(ids), width, dtype=torch.long)
    attention = torch.zeros(len(ids), width, dtype=torch.long)
    for b, x in enumerate(ids):
        tokens[b, : len(x)] = torch.tensor(x)
        attention[b, : len(x)] = 1
    captured = []
    hook = decoder_layers(model)[layer].register_forward_hook(
        lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        final = (
            pretrained(model)
            .get_decoder()(input_ids=tokens.to(device), attention_mask=attention.to(device))
            .last_hidden_state
        )
    finally:
        hook.remove()
    return [(captured[0][b, : len(x)], final[b, : len(x)]) for b, x in enumerate(ids)]


def build_features(
    cfg: TrainingRun, target: LoadedModel, docs: list[dict[str, Any]], progress: bool = True
) -> list[Example]:
    path = cfg.work_dir / f"features-{cfg.features_key()}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        return [Example(**e) for e in saved]
    n = cfg.train.seq_len
    windows, seen = [], set()
    for d in docs:
        ids = d["ids"][-n:]
        # Samples of one prompt with short replies (an action, a label) share nearly their whole
        # window: one of them is enough.
        key = tuple(ids[: len(ids) - DISTINCT_TAIL])
        if len(ids) >= 2 and key not in seen:
            seen.add(key)
            windows.append((d["id"].rsplit("/", 1)[0], ids))
    order = sorted(range(len(windows)), key=lambda i: len(windows[i][1]))
    examples: list[Example | None] = [None] * len(windows)
    batch = 8
    for start in tqdm(range(0, len(order), batch), desc="features", unit="batch", disable=not progress):
        idx = order[start : start + batch]
        feats = target_features(target.model, cfg.layer, [windows[i][1] for i in idx])
        for i, (h, f) in zip(idx, feats):
            group, ids = windows[i]
            examples[i] = Example(group, torch.tensor(ids), h.to(torch.float16).cpu(), f.to(torch.float16).cpu())
    out = [e for e in examples if e is not None]
    tmp = path.with_suffix(".tmp")
    torch.save([asdict(e) for e in out], tmp)
    tmp.replace(path)
    return out


def split(examples: list[Example], heldout: float) -> tuple[list[Example], list[Example]]:
    """Held-out examples are those of a fixed fraction of the problems (by a hash of the problem id)."""
    groups = sorted({e.group for e in examples}, key=lambda g: zlib.crc32(g.encode()))
    n_held = max(1, round(heldout * len(groups))) if len(groups) > 1 else 0
    held = set(groups[:n_held])
    return [e for e in examples if e.group not in held], [e for e in examples if e.group in held]


# --- 3. training --------------------------------------------------------------------------------


def batch_loss(edd: EddModel, batch: list[Example], block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean KL(P_target || P_edd), top-1 agreement) over a batch's tokens under the dual-block mask."""
    n = max(len(e.ids) for e in batch)
    hidden_size = edd.lm_config.hidden_size
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    hidden = torch.zeros(len(batch), n, hidden_size)
    final = torch.zeros(len(batch), n, hidden_size)
    valid = torch.zeros(len(batch), n, dtype=torch.bool)
    for b, e in enumerate(batch):
        k = len(e.ids)
        ids[b, :k], hidden[b, :k], final[b, :k], valid[b, :k] = e.ids, e.hidden.float(), e.final.float(), True
    device, dtype = edd.device, edd.dtype
    embeds = torch.cat([hidden.to(device, dtype), edd.embed(ids)], 1)
    visible = dual_block_mask(n, block_len).to(device)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    positions = torch.cat([torch.arange(n), torch.arange(n)])[None].to(device)
    logits = edd(embeds, mask[None, None], positions, logits_at=torch.arange(n, 2 * n))
    with torch.no_grad():
        target_logits = edd.head(final.to(device, dtype))
    valid = valid.to(device)
    loss = kl_to_target(logits, target_logits, valid)
    agree = ((logits.argmax(-1) == target_logits.argmax(-1)) & valid).sum() / valid.sum()
    return loss, agree.detach()


@torch.no_grad()
def evaluate(edd: EddModel, examples: list[Example], block_len: int, batch_size: int) -> tuple[float, float]:
    """Token-weighted held-out KL and top-1 agreement."""
    total = agree = tokens = 0.0
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        n = sum(len(e.ids) for e in batch)
        loss, acc = batch_loss(edd, batch, block_len)
        total += float(loss.detach()) * n
        agree += float(acc) * n
        tokens += n
    return total / max(tokens, 1), agree / max(tokens, 1)


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup, then cosine decay to a tenth of train.lr."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train(
    cfg: TrainingRun,
    target: LoadedModel,
    examples: list[Example],
    progress: bool = True,
    vocab: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Train (or resume) an EDD and save it to cfg.out with `vocab`, the corpus's token ranking
    (draft.vocab); returns the training summary."""
    s = cfg.train
    torch.manual_seed(s.seed)
    edd = EddModel(EddConfig(cfg.model.path, cfg.layer, s.min_block, s.max_block, cfg.init_layer), target.model).train()
    params = [p for p in edd.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    train_set, held = split(examples, s.heldout)
    if not train_set or not held:
        raise ConfigError(
            f"the corpus has {len(examples)} texts from too few problems to hold some out; add problems "
            "(corpus.<task>.limit) or lower train.heldout"
        )
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt = cfg.work_dir / f"checkpoint-{cfg.run_key()}.pt"
    step, history = 0, []
    order: list[int] = []  # the rest of this epoch's shuffled training texts
    rng = random.Random(s.seed)
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        edd.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, history, order = state["step"], state["history"], state["order"]
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        tqdm.write(f"resuming from {ckpt} at step {step}")
    log_line = _reporter(history)
    if step == 0 and not history:
        log_line(0, *evaluate(edd, held, s.eval_block, s.batch_size), None)
    recent: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(total=s.steps, initial=step, desc="train EDD", unit="step", disable=not progress)
    while step < s.steps:
        if len(order) < s.batch_size:
            order += rng.sample(range(len(train_set)), len(train_set))
        batch = [train_set[i] for i in order[: s.batch_size]]
        del order[: s.batch_size]
        block_len = rng.randint(s.min_block, s.max_block)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s)
        loss, _ = batch_loss(edd, batch, block_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        recent.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(kl=f"{sum(recent[-20:]) / len(recent[-20:]):.3f}")
        if step % s.eval_every == 0 or step == s.steps:
            log_line(step, *evaluate(edd, held, s.eval_block, s.batch_size), sum(recent) / len(recent))
            recent = []
        if step % s.checkpoint_every == 0 or step == s.steps:
            state = {
                "model": edd.trained_state(),
                "opt": opt.state_dict(),
                "step": step,
                "history": history,
                "order": order,
                "rng": rng.getstate(),
                "torch_rng": torch.get_rng_state(),
            }
            tmp = ckpt.with_suffix(".tmp")
            torch.save(state, tmp)
            tmp.replace(ckpt)
    bar.close()
    summary = {
        "steps": step,
        "train_texts": len(train_set),
        "heldout_texts": len(held),
        "train_tokens": sum(len(e.ids) for e in train_set),
        "heldout_kl_first": history[0]["heldout_kl"] if history else None,
        "heldout_kl": history[-1]["heldout_kl"] if history else None,
        "heldout_top1": history[-1]["heldout_top1"] if history else None,
        "history": history,
        "train_s_this_run": time.perf_counter() - t0,
        "settings": asdict(s),
    }
    save_edd(edd.eval(), cfg.out, {"training": summary}, vocab)
    return summary


def _reporter(history: list[dict[str, Any]]) -> Callable[[int, float, float, float | None], None]:
    def report(step: int, kl: float, top1: float, train_kl: float | None) -> None:
        history.append({"step": step, "heldout_kl": kl, "heldout_top1": top1, "train_kl": train_kl})
        extra = "" if train_kl is None else f", train KL {train_kl:.4f}"
        tqdm.write(f"step {step}: held-out KL {kl:.4f}, held-out top-1 agreement {top1:.3f}{extra}")

    return report
