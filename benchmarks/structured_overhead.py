"""Decode speed with and without a JSON-schema constraint, same model, same prompt, one run.

Rounds alternate the order (free, constrained / constrained, free). Decode tok/s is the tokens
after the first over their time (``GenerationResponse.generation_tps``), so prefill is excluded.
Both runs generate the same number of tokens: both ban EOS with the same logits processor, and
the schema (an array of at least 200 strings) cannot end within ``--tokens``. The time llguidance spends in ``next_mask`` is measured separately:
it is what each token would cost extra if the mask were not computed while the model runs.

mlx-lm has no constrained decoding, so there is no mlx-lm column here (see vs_mlx_lm.py for
the unconstrained comparison).

Usage: python benchmarks/structured_overhead.py [--tokens 128] [--rounds 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 200}},
    "required": ["fruits"],
}
PROMPT = "List as many fruits as you can, as JSON: {\"fruits\": [...]}."


class TimedConstraint:
    """Wraps a constraint and adds up the wall time of its ``next_mask`` calls."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.mask_seconds = 0.0
        self.masks = 0

    def next_mask(self):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        mask = self.inner.next_mask()
        self.mask_seconds += time.perf_counter() - start
        self.masks += 1
        return mask

    def advance(self, token: int) -> None:
        self.inner.advance(token)

    @property
    def done(self) -> bool:
        return self.inner.done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: the offline SmolLM2-135M-Instruct GGUF")
    args = parser.parse_args()

    from mlxformer.cache import make_cache
    from mlxformer.constrained import make_constraint
    from mlxformer.default_model import default_model_path
    from mlxformer.generation.decoding import DecodingState
    from mlxformer.generation.stream import decode
    from mlxformer.loader import load
    from mlxformer.sampling.options import SamplingSettings

    model, tokenizer = load(args.model or default_model_path())
    prompt = tokenizer.encode_prompt(PROMPT)
    vocab = model.args.vocab_size
    no_eos = SamplingSettings(logit_bias={t: -100.0 for t in tokenizer.eos_token_ids})

    def run(constrained: bool) -> tuple[float, int, float]:
        """(decode tok/s after the first token, tokens, next_mask ms per token)."""
        constraint = TimedConstraint(make_constraint(tokenizer, vocab, response_format=SCHEMA)) if constrained else None
        state = DecodingState(prompt, sampling=no_eos, max_tokens=args.tokens, constraint=constraint,
                              cache=make_cache(model))
        tokens = decode(model, state)
        count, first = 0, 0.0
        for count, _ in enumerate(tokens, start=1):
            if count == 1:
                first = time.perf_counter()
        assert count == args.tokens and (constraint is None or not constraint.done)
        tps = (count - 1) / (time.perf_counter() - first)
        mask_ms = 1e3 * constraint.mask_seconds / constraint.masks if constraint else 0.0
        return tps, count, mask_ms

    run(False), run(True)  # warm-up (and the grammar vocabulary is built once here)
    free, constrained, mask_ms = [], [], []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for c in order:
            tps, n, ms = run(c)
            (constrained if c else free).append(tps)
            if c:
                mask_ms.append(ms)
            print(f"round {r + 1} {'constrained' if c else 'free':>11}: {n} tokens, {tps:6.2f} tok/s"
                  + (f", next_mask {ms:.3f} ms/token" if c else ""), flush=True)
    f, c, m = statistics.median(free), statistics.median(constrained), statistics.median(mask_ms)
    print(f"\nmedian decode: free {f:.2f} tok/s, JSON-schema constrained {c:.2f} tok/s; "
          f"ratio {c / f:.3f} (overhead {100 * (1 - c / f):.1f}% per token)")
    print(f"median next_mask: {m:.3f} ms/token = {100 * m * f / 1e3:.1f}% of a free decode step "
          f"(computed while the model runs the step)")


if __name__ == "__main__":
    main()
