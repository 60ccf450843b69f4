"""How far an engine over quantized numbers (an int8 KV pool, w8a8 projections) serves from its float reference."""

import numpy as np

from meshlm.serve.params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 8], [42, 7, 7, 130, 2, 9], [1, 2, 3], [200, 100, 50, 25, 12, 6, 7, 301, 44]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
SCORED = SamplingParams(max_new_tokens=0, temperature=0.0, prompt_logprobs=0)


def drift(reference, *engines) -> list[tuple[float, float]]:
    """Over PROMPTS, for each of `engines`: the share of positions where its greedy tokens are `reference`'s, and the
    largest gap between its prompt logprobs and the reference's over the reference's greedy texts (once one greedy
    token differs, the rest of that row follows another text, so the gap is measured on one text for both). The
    reference generates and scores once for all."""
    want = reference.generate(PROMPTS, [GREEDY] * len(PROMPTS))
    texts = [p + w.tokens for p, w in zip(PROMPTS, want, strict=True)]
    exact = reference.generate(texts, [SCORED] * len(texts))
    measures = []
    for engine in engines:
        got = engine.generate(PROMPTS, [GREEDY] * len(PROMPTS))
        same = [a == b for w, g in zip(want, got, strict=True) for a, b in zip(w.tokens, g.tokens, strict=True)]
        other = engine.generate(texts, [SCORED] * len(texts))
        gap = max(abs(a - b) for x, y in zip(exact, other, strict=True)
                  for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True))  # fmt: skip
        measures.append((float(np.mean(same)), gap))
    return measures
