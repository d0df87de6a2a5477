"""Speculative decoding: decode speed with and without it, mlxformer beside mlx-lm.

An input-grounded task (repeat a ~300-token text given in the prompt, greedy) on the same
model files for both runtimes, rounds interleaved in one run:

- mlxformer plain and with --prompt-lookup (no second model) on the float32 and bfloat16
  SmolLM2, and the 4-bit model drafting for the float32 one;
- mlx-lm plain and with the same draft model on the float32 target (mlx-lm has no prompt
  lookup).

Prints decode tok/s medians, the speed-ups and mlxformer / mlx-lm ratios, and the acceptance.
Needs ``python benchmarks/prepare_models.py --skip-1b`` first.

Usage: python benchmarks/speculative.py [--models .bench/models] [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

TEXT = (
    "The river town of Ashford woke slowly on market days. Before dawn the bakers lit their ovens, "
    "and by six the smell of bread drifted across the square where the farmers unloaded their carts. "
    "There were apples from the northern orchards, cheeses wrapped in cloth, jars of honey that caught "
    "the first light, and baskets of eggs that the children were told never to touch. The mayor, a "
    "careful man who wrote everything down, walked the rows with his notebook and counted the stalls. "
    "Forty-two this week, he wrote, two more than last. At the far end of the square an old woman sold "
    "seeds from small paper envelopes, each one labelled in her neat handwriting: beans, marigolds, "
    "sweet peas, a kind of tomato nobody else grew. People said her garden was the best in the valley, "
    "though no one had ever seen it. When the church bell rang nine the square was full, and the noise "
    "of bargaining rose over the river, where the ferryman waited with his long pole for the first "
    "travellers from the other bank. By noon the carts were empty and the farmers counted their coins, "
    "and the mayor closed his notebook, satisfied that the town was doing well."
)
PROMPT = f"Repeat the following text exactly, word for word.\n\n{TEXT}"


def median_tps(times: list[float], tokens: int) -> float:
    return tokens / statistics.median(times)


def mlxformer_runners(models: Path, tokens: int) -> dict[str, Callable[[], tuple[float, int, int]]]:
    import mlx.core as mx

    from mlxformer import load, stream_generate
    from mlxformer.speculative.speculator import SpeculativeSettings

    loaded = {name: load(models / name) for name in ("smollm2-f32", "smollm2-bf16", "smollm2-4bit")}
    ids = loaded["smollm2-f32"][1].encode_prompt(PROMPT)

    def run(name: str, speculative: SpeculativeSettings | None) -> tuple[float, int, int]:
        model, tokenizer = loaded[name]
        first = None
        last = None
        for last in stream_generate(model, tokenizer, ids, tokens, speculative=speculative):
            if first is None:
                mx.synchronize()
                first = time.perf_counter()
        assert last is not None and first is not None
        return time.perf_counter() - first, last.proposed_tokens, last.accepted_tokens

    lookup = SpeculativeSettings(prompt_lookup=True, num_draft_tokens=8)
    draft_model, draft_tokenizer = loaded["smollm2-4bit"]
    drafted = SpeculativeSettings(draft_model=draft_model, draft_tokenizer=draft_tokenizer, num_draft_tokens=4)
    return {
        "mlxformer f32 plain": lambda: run("smollm2-f32", None),
        "mlxformer f32 prompt lookup": lambda: run("smollm2-f32", lookup),
        "mlxformer f32 draft 4-bit": lambda: run("smollm2-f32", drafted),
        "mlxformer bf16 plain": lambda: run("smollm2-bf16", None),
        "mlxformer bf16 prompt lookup": lambda: run("smollm2-bf16", lookup),
    }


def mlx_lm_runners(models: Path, tokens: int) -> dict[str, Callable[[], tuple[float, int, int]]]:
    from mlx_lm import load, stream_generate

    target, tokenizer = load(str(models / "smollm2-f32"))
    draft_model, _ = load(str(models / "smollm2-4bit"))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)

    def run(draft=None) -> tuple[float, int, int]:
        first = None
        accepted = 0
        options = {"draft_model": draft, "num_draft_tokens": 4} if draft is not None else {}
        for response in stream_generate(target, tokenizer, prompt, max_tokens=tokens, **options):
            if first is None:
                first = time.perf_counter()
            accepted += bool(getattr(response, "from_draft", False))
        assert first is not None
        return time.perf_counter() - first, 0, accepted

    return {"mlx-lm f32 plain": lambda: run(None), "mlx-lm f32 draft 4-bit": lambda: run(draft_model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path(".bench/models"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    runners = {**mlxformer_runners(args.models, args.tokens), **mlx_lm_runners(args.models, args.tokens)}
    for run in runners.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    acceptance: dict[str, tuple[int, int]] = {}
    for round_index in range(args.rounds):
        order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
        for name in order:
            seconds, proposed, accepted = runners[name]()
            times[name].append(seconds)
            acceptance[name] = (accepted, proposed)
            print(f"  round {round_index + 1}: {name}: {(args.tokens - 1) / seconds:.2f} tok/s", flush=True)
    tps = {name: median_tps(t, args.tokens - 1) for name, t in times.items()}
    print(f"decode tok/s (median of {args.rounds}, {args.tokens} tokens, greedy)")
    for name, value in tps.items():
        accepted, proposed = acceptance[name]
        extra = f"  accepted {accepted}/{proposed}" if proposed else (f"  {accepted} from draft" if accepted else "")
        print(f"  {name:30s} {value:7.2f}{extra}")
    print("speed-up over plain decoding, same runtime and model:")
    for name, plain in (("mlxformer f32 prompt lookup", "mlxformer f32 plain"),
                        ("mlxformer f32 draft 4-bit", "mlxformer f32 plain"),
                        ("mlxformer bf16 prompt lookup", "mlxformer bf16 plain"),
                        ("mlx-lm f32 draft 4-bit", "mlx-lm f32 plain")):
        print(f"  {name:30s} {tps[name] / tps[plain]:.2f}x")
    print("mlxformer / mlx-lm (float32 target):")
    print(f"  plain                          {tps['mlxformer f32 plain'] / tps['mlx-lm f32 plain']:.2f}x")
    print(f"  draft 4-bit                    {tps['mlxformer f32 draft 4-bit'] / tps['mlx-lm f32 draft 4-bit']:.2f}x")
    best = max(tps["mlx-lm f32 plain"], tps["mlx-lm f32 draft 4-bit"])
    print(f"  prompt lookup vs mlx-lm's best {tps['mlxformer f32 prompt lookup'] / best:.2f}x")


if __name__ == "__main__":
    main()
