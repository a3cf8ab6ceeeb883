"""`decoder=hf`: each request alone through `transformers` `generate`, the ToT / SEED baseline."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from decoding.base.values import DecodeStats
from decoding.drafters.base import Drafter, NoDrafter
from decoding.runtime.runner import ModelRunner
from decoding.schedules.base import Step, run_to_end
from decoding.speculation.gumbel import gumbel_choice
from decoding.speculation.logprobs import Asked, token_logprobs
from decoding.speculation.options import Rule
from decoding.speculation.sequence import Sequence
from decoding.speculation.stopping import Detokenizer


class GumbelSampler(LogitsProcessor):
    """The project's sampler inside `generate`'s greedy search: every token but the Gumbel-max
    sample at this position (the length so far: prompt plus tokens generated) is masked out."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        token = gumbel_choice(scores[0], self.seq.params, self.seq.seed, input_ids.shape[1])
        out = torch.full_like(scores, float("-inf"))
        out[0, token] = 0.0
        return out


class _StopRuleCriteria(StoppingCriteria):
    """Ends `generate` where our StopRule says, so `hf` and our decoders cut sequences alike."""

    def __init__(self, seq: Sequence, prompt_len: int, tokenizer: Detokenizer) -> None:
        self.seq, self.prompt_len, self.tokenizer = seq, prompt_len, tokenizer

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        generated = input_ids[0, self.prompt_len :].tolist()
        _, reason = self.seq.rule.check(generated, self.tokenizer, start=len(generated) - 1)
        return torch.tensor([reason is not None], device=input_ids.device)


def answer_logprobs(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> float:
    """An answer's log-probability after `prompt` by one plain forward over both: the sum of its
    tokens' raw log-softmax (what a choice request's tree reads in one forward for all answers)."""
    ids = torch.tensor([prompt + answer], device=next(model.parameters()).device)
    logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    return float(sum(logp.gather(-1, ids[0, len(prompt) :, None])[:, 0].tolist()))


class HFDecoder:
    """Requests one at a time, each through `generate` to its end: a step decodes one whole sequence."""

    name = "hf"
    live = 0  # a sequence is decoded within one step

    def __init__(self, target: ModelRunner, tokenizer: Detokenizer, rule: Rule = "match_gumbel") -> None:
        self.drafter: Drafter = NoDrafter()  # transformers drafts nothing here
        self.target = target
        self.tokenizer = tokenizer
        # Plain decoding's sampler under the rule: torch.multinomial's stream for match_multinomial,
        # else Gumbel-max with public noise (rejection rules decide drafted tokens only).
        self.multinomial = rule == "match_multinomial"
        self.waiting: deque[Sequence] = deque()

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    def admit(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def clear(self) -> None:
        self.waiting.clear()

    def run(self, seqs: list[Sequence]) -> DecodeStats:
        return run_to_end(self, seqs)

    def step(self) -> Step:
        # generate() fills every option a call leaves unset from the model's generation_config, which
        # may carry the checkpoint's own sampling options (repetition_penalty, min_p, ...). Every
        # decoder samples only the request's temperature / top-k / top-p, so run with a neutral one.
        model: Any = self.target.model  # a transformers model: its generation_config, generate
        saved = model.generation_config
        model.generation_config = GenerationConfig()
        try:
            s = self.waiting.popleft()
            return Step([s], self._generate(s))
        finally:
            model.generation_config = saved

    @torch.inference_mode()
    def _generate(self, s: Sequence) -> DecodeStats:
        """Decode `s` to its end; what it cost."""
        stats = DecodeStats()
        model: Any = self.target.model  # a transformers model: its generate
        t0 = time.perf_counter()
        ids = torch.tensor([s.prompt], device=self.target.device)
        if s.choices is not None:
            s.scored(self._choices(s))
            stats.target_forwards = stats.target_rows = len(s.choices.paths)
            stats.prompt_tokens = stats.prompt_tokens_computed = len(s.prompt)
            stats.verify_s += time.perf_counter() - t0
            return stats
        sampling: dict[str, object] = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        processors = LogitsProcessorList()
        if not s.params.greedy and self.multinomial:
            # generate draws from the global RNG; seeding it per request keeps runs reproducible.
            torch.manual_seed(s.seed)
            sampling = {
                "do_sample": True,
                "temperature": s.params.temperature,
                "top_k": s.params.top_k,
                "top_p": s.params.top_p,
            }
        elif not s.params.greedy:
            processors.append(GumbelSampler(s))  # greedy search over the sampler's one-token mask
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=s.rule.max_new_tokens,
            eos_token_id=sorted(s.rule.eos_ids),
            pad_token_id=min(s.rule.eos_ids),
            stopping_criteria=StoppingCriteriaList([_StopRuleCriteria(s, ids.shape[1], self.tokenizer)]),
            logits_processor=processors,
            # The raw logits of every step (a vocabulary's floats each) only where log-probabilities are asked.
            output_logits=s.top_logprobs is not None,
            return_dict_in_generate=True,
            **sampling,
        )
        generated = out.sequences[0, ids.shape[1] :].tolist()
        s.commit(generated, self.tokenizer)
        if s.top_logprobs is not None:
            logits = torch.cat(out.logits)[: len(s.generated)]
            asked = Asked(logits, list(range(len(s.generated))), s.generated, s.params, s.top_logprobs)
            s.logprobs = token_logprobs([asked])[0]
        s.reason = s.reason or "length"
        # generate runs one forward per new token; count them like the other decoders do.
        s.stats.verify_steps = s.stats.target_forwards = s.stats.generated_tokens
        stats.target_forwards += s.stats.generated_tokens
        stats.target_rows += s.stats.generated_tokens  # one sequence per forward
        stats.prompt_tokens += len(s.prompt)
        stats.prompt_tokens_computed += len(s.prompt)  # no prefix reuse
        s.stats.prompt_tokens_computed = len(s.prompt)
        stats.verify_s += time.perf_counter() - t0
        return stats

    def _choices(self, s: Sequence) -> list[float]:
        """Each answer of a choice by a plain forward of the prompt and it (one sequence at a time)."""
        assert s.choices is not None
        tree = s.choices.tree
        answers = [[tree.tokens[n] for n in path] for path in s.choices.paths]
        return [answer_logprobs(self.target.model, s.prompt, a) for a in answers]
