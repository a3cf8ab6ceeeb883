"""`decoder=hf`: each request alone through `transformers` `generate`, the ToT / SEED baseline."""

from __future__ import annotations

import time
from collections import deque

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from decoding.core.runner import ModelRunner
from decoding.core.sequence import Sequence
from decoding.core.stopping import Detokenizer
from decoding.core.values import DecodeStats
from decoding.drafters.base import NoDrafter
from decoding.schedules.base import run_to_end


class _StopRuleCriteria(StoppingCriteria):
    """Ends `generate` where our StopRule says, so `hf` and our decoders cut sequences alike."""

    def __init__(self, seq: Sequence, prompt_len: int, tokenizer: Detokenizer) -> None:
        self.seq, self.prompt_len, self.tokenizer = seq, prompt_len, tokenizer

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        generated = input_ids[0, self.prompt_len :].tolist()
        _, reason = self.seq.rule.check(generated, self.tokenizer, start=len(generated) - 1)
        return torch.tensor([reason is not None], device=input_ids.device)


class HFDecoder:
    """Requests one at a time, each through `generate` to its end: a step decodes one whole sequence."""

    name = "hf"
    live = 0  # a sequence is decoded within one step

    def __init__(self, target: ModelRunner, tokenizer: Detokenizer) -> None:
        self.drafter = NoDrafter()  # transformers drafts nothing here
        self.target = target
        self.tokenizer = tokenizer
        self.waiting: deque[Sequence] = deque()
        self.stats = DecodeStats()

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    def admit(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def clear(self) -> None:
        self.waiting.clear()

    def run(self, seqs: list[Sequence]) -> DecodeStats:
        return run_to_end(self, seqs)

    def step(self) -> list[Sequence]:
        # generate() fills every option a call leaves unset from the model's generation_config, which
        # may carry the checkpoint's own sampling options (repetition_penalty, min_p, ...). Every
        # decoder samples only the request's temperature / top-k / top-p, so run with a neutral one.
        model = self.target.model
        saved = model.generation_config
        model.generation_config = GenerationConfig()
        try:
            s = self.waiting.popleft()
            self._generate(s)
            return [s]
        finally:
            model.generation_config = saved

    @torch.inference_mode()
    def _generate(self, s: Sequence) -> None:
        stats, model = self.stats, self.target.model
        t0 = time.perf_counter()
        ids = torch.tensor([s.prompt], device=self.target.device)
        sampling: dict[str, object] = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        if not s.params.greedy:
            # generate draws from the global RNG; seeding it per request keeps runs reproducible.
            torch.manual_seed(s.generator.initial_seed())
            sampling = {
                "do_sample": True,
                "temperature": s.params.temperature,
                "top_k": s.params.top_k,
                "top_p": s.params.top_p,
            }
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=s.rule.max_new_tokens,
            eos_token_id=sorted(s.rule.eos_ids),
            pad_token_id=min(s.rule.eos_ids),
            stopping_criteria=StoppingCriteriaList([_StopRuleCriteria(s, ids.shape[1], self.tokenizer)]),
            **sampling,
        )
        generated = out[0, ids.shape[1] :].tolist()
        s.commit(generated, self.tokenizer)
        s.reason = s.reason or "length"
        # generate runs one forward per new token; count them like the other decoders do.
        s.stats.verify_steps = s.stats.target_forwards = s.stats.generated_tokens
        stats.target_forwards += s.stats.generated_tokens
        stats.target_rows += s.stats.generated_tokens  # one sequence per forward
        stats.prompt_tokens += len(s.prompt)
        stats.prompt_tokens_computed += len(s.prompt)  # no prefix reuse
        s.stats.prompt_tokens_computed = len(s.prompt)
        stats.verify_s += time.perf_counter() - t0
