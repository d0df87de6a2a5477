"""A step's working memory beside the KV cache (issue 32: the process's peak growth over its
weights within the KV budget): the activations one engine step holds at once, bounded from
the model's shape, the step's tokens and the longest context the KV budget can hold.

What a step allocates beside the caches (measured on SmolLM2-135M float32, 128-token chunks,
``benchmarks/rss_profile.py``, ``docs/design/scheduler-measurements.md``): the attention scores and their
softmax of the largest layer (``(T, heads, S)`` each, float32 on the CPU's unfused path: 9 MiB
at S = 1,000), the mask, the cache's keys and values made contiguous for the matmul, the MLP's
three ``(T, intermediate)`` arrays, a few ``(T, hidden)`` residuals, and the logits of the rows
that sample (float32, with the sampling graph's copies); layers run one after the other, so one
layer's worth is live at a time. MLX keeps freed buffers for reuse (its cache, resident memory
too): under a budget the engine bounds that cache by the same figure, so a step's activations
and the buffers kept for the next one stay within ``2 x reserve``. (Metal's fused attention
does not materialize the scores: there the reserve overstates; not measured.) Not covered: a
request asking for ``prompt_logprobs`` projects every prompt position, ``(T, vocab)``.
"""

from __future__ import annotations

from mlxformer.models.config import ModelArgs

SCORE_BYTES = 4  # attention scores and sampling run in float32 (the CPU's unfused attention too)
LOGIT_COPIES = 4  # the logits, their float32 copy, the sampler's sorted values and probabilities
HIDDEN_COPIES = 4  # the residual stream, the normed input, the attention and MLP outputs


def mlp_width(args: ModelArgs) -> int:
    """The widest MLP intermediate a token goes through (a dense MLP, or its routed experts and
    shared experts together)."""
    routed = args.moe_intermediate_size * max(args.num_experts_per_tok, 1) if args.moe_intermediate_size else 0
    shared = args.shared_expert_intermediate_size + args.n_shared_experts * args.moe_intermediate_size
    dense = args.intermediate_size * (2 if args.double_wide_mlp else 1)
    return max(dense, routed + shared)


def step_reserve(args: ModelArgs, tokens: int, context: int, rows: int, act_bytes: int) -> int:
    """Bytes of activations one engine step may hold beside the KV cache: ``tokens`` tokens in
    its forward (decode rows and prompt chunks), attending over at most ``context`` keys each,
    ``rows`` of them sampling a token; ``act_bytes``: the activations' dtype size."""
    heads = args.num_attention_heads
    head_dim = max(args.head_dim, args.global_head_dim)
    scores = 2 * tokens * heads * context * SCORE_BYTES  # the scores and their softmax
    mask = tokens * context * SCORE_BYTES
    keys = 2 * args.num_key_value_heads * context * head_dim * act_bytes  # the cache's keys/values made contiguous
    qkv = tokens * (heads + 2 * args.num_key_value_heads) * head_dim * act_bytes
    mlp = 3 * tokens * mlp_width(args) * act_bytes  # gate, up, and their product
    hidden = HIDDEN_COPIES * tokens * args.hidden_size * act_bytes
    logits = LOGIT_COPIES * rows * args.vocab_size * SCORE_BYTES
    return scores + mask + keys + qkv + mlp + hidden + logits


def engine_reserve(
    args: ModelArgs, limit: int, per_token: float, step_tokens: int, prefill_chunk: int, max_batch: int,
    draft_tokens: int, act_bytes: int,
) -> int:
    """``step_reserve`` of an engine's largest step under a KV budget of ``limit`` bytes
    (``per_token``: the caches' bytes per token, so no sequence attends over more than
    ``limit / per_token`` keys): a step runs at most ``step_tokens`` (or one whole chunk) beside
    ``max_batch`` decoding rows, and each of those samples ``1 + draft_tokens`` positions."""
    context = max(1, min(args.max_position_embeddings + draft_tokens, int(limit / max(per_token, 1e-9))))
    tokens = max(step_tokens, prefill_chunk) + max_batch * (1 + draft_tokens)
    return step_reserve(args, tokens, context, max_batch * (1 + draft_tokens), act_bytes)
