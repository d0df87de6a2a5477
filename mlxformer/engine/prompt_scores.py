"""The log-probabilities of a prompt's own tokens, gathered while the prompt is prefilled
(OpenAI's ``echo`` with ``logprobs``: what lm-evaluation-harness's loglikelihood tasks read).

Row ``j`` of a chunk starting at prompt position ``s`` predicts token ``s + j + 1``; the prompt's
first token has no prediction. The arrays stay lazy until the prefill step evaluates them.
"""

from __future__ import annotations

import mlx.core as mx

from mlxformer.sampling.samplers import normalize, top_logprobs


class PromptScores:
    """Each prompt token's log-probability given the tokens before it, and the ``top`` most
    likely tokens at each position (``GenerationRequest.prompt_logprobs``)."""

    def __init__(self, prompt: list[int], top: int) -> None:
        self.prompt, self.top = prompt, top
        self.scored = 1  # the next prompt position to score (position 0 has no prediction)
        self._scores: list[tuple[mx.array, mx.array, mx.array]] = []  # each chunk's chosen (k,), top ids and values (k, top)

    def add(self, start: int, logits: mx.array) -> list[mx.array]:
        """Score the tokens predicted by a chunk's logits ``(T, vocab)`` (the chunk starts at prompt
        position ``start``); returns the new arrays, to be evaluated with the step. A chunk seen
        before (a recomputed prefill) adds nothing."""
        if start + 1 != self.scored:
            return []
        targets = self.prompt[start + 1 : start + 1 + logits.shape[0]]
        if not targets:
            return []
        logprobs = normalize(logits[: len(targets)])  # (k, vocab) float32
        chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]  # (k,)
        if self.top:
            top_ids, top_values = top_logprobs(logprobs, self.top)  # (k, top): a partition, not a sort
        else:
            top_ids = top_values = mx.zeros((logprobs.shape[0], 0), mx.int32)
        self._scores.append((chosen, top_ids, top_values))
        self.scored += len(targets)
        return [chosen, top_ids, top_values]

    def entries(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """For prompt positions 1.. (once the prefill is done): ``(logprob, [(id, logprob), ...])``."""
        return [(lp, list(zip(row_ids, row_values))) for chosen, ids, values in self._scores
                for lp, row_ids, row_values in zip(chosen.tolist(), ids.tolist(), values.tolist())]
