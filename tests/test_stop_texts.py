"""The stop check's token texts (decoding/speculation/stopping.py `TokenTexts`): tokenizer logic, apart
from test_sampling.py, which the CUDA list runs on a device without the embedded model's package."""

from __future__ import annotations

import pytest

from decoding.speculation.stopping import StopRule


class CountingTokenizer:
    """A tokenizer that counts its decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decodes = tokenizer, 0

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.decodes += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_token_texts_skip_no_stop(which):
    """The stop check decodes a tail only after a token whose own text can end a stop string: on random
    sequences of newlines, multi-byte characters cut across tokens, special tokens and words, it stops
    where the check of every token stops, and decodes a fraction as often. Stop strings ending in a
    space or a non-ASCII character are checked after every token."""
    import random

    from conftest import build_tokenizer

    from decoding import ModelSpec, load_tokenizer
    from decoding.speculation.stopping import TokenTexts

    tokenizer = build_tokenizer() if which == "tiny" else load_tokenizer(ModelSpec())[0]
    text = "Step 1: 3 + 4 = 7.\n\nStep 2: é, 中文 and 🙂 END\nAnswer: a b\n"
    pool = sorted({*tokenizer.encode(text), *tokenizer.all_special_ids})
    pool += [t for t in tokenizer.encode("🙂中") if t not in pool]  # byte pieces of multi-byte characters
    rng = random.Random(0)
    texts = TokenTexts()
    for stop in [("\n\n",), ("\nStep", "END"), ("é",), ("a ",), ("7.", "\n\n")]:
        every = CountingTokenizer(tokenizer)
        some = CountingTokenizer(tokenizer)
        stops = 0
        for _ in range(40):
            generated = [rng.choice(pool) for _ in range(50)]
            full, filtered = StopRule(frozenset(), stop, 50), StopRule(frozenset(), stop, 50, texts)
            for n in range(1, len(generated) + 1):
                got = filtered.check(generated[:n], some, start=n - 1)
                assert got == full.check(generated[:n], every, start=n - 1)
                stops += got[1] == "stop"
        if all(set(s) <= set(tokenizer.decode(pool)) for s in stop):  # the tiny one has no newline
            assert stops > 0, stop  # the sequences do meet the stop strings
        if filtered._last_chars is None:
            assert stop in [("é",), ("a ",)]
        else:
            assert some.decodes < every.decodes / 2, (stop, some.decodes, every.decodes)
