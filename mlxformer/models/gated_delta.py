"""Gated DeltaNet: the linear-attention mixer of the ``linear_attention`` layers of Qwen3.5/3.6
and Qwen3-Next (``ModelArgs.layer_types`` entry ``"linear"``).

Per value head, with a state ``S (Dk, Dv)`` carried from token to token:

    S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - S^T k_t))^T;   o_t = S^T q_t

q, k and v come from one projection through a short causal depthwise conv1d and SiLU; q and k
are L2-normalised (q also scaled by ``Dk ** -0.5``) and repeated from the key heads to the
value heads; ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``. The output is
RMS-normalised per head, gated by ``silu(z)`` and projected by ``out_proj``.

Two forms compute the rule (float32, as transformers does): ``chunked_delta_rule`` (prefill:
within a chunk of ``CHUNK`` tokens (``CPU_CHUNK`` on the CPU) a unit-triangular system, between chunks the recurrence) and
``recurrent_delta_rule`` (decode and the last tokens of an update, whose states the cache keeps
so that it can take tokens back, see ``cache.state``). Both are MLX ops; on a Metal GPU the
recurrent form runs as one kernel instead (``gated_delta_kernel``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxformer.cache.packed import cut_tokens, join_tokens
from mlxformer.cache.protocol import Cache
from mlxformer.cache.state import StateCache
from mlxformer.models.config import ModelArgs
from mlxformer.models.gated_delta_kernel import metal_recurrent_delta_rule, uses_kernel
from mlxformer.models.mask import Mask

CHUNK = 64  # tokens per chunk of the parallel form on a GPU (transformers' and FLA's default)
# On the CPU (MLX's reference BLAS) smaller chunks are ~2.3x faster: a chunk's C x C products
# cost C^3, and the between-chunk recurrence is matrix products too (measured: 128 tokens, 32
# heads of 128, float32: C=64 1072-1153 ms, C=32 576-612, C=16 435-481, C=8 442-518).
CPU_CHUNK = 16
MIN_CHUNKED = 8  # shorter updates run token by token (the chunked form pads to a whole chunk)


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (FLA's and transformers' l2norm)."""
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def recurrent_delta_rule(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, list[mx.array]]:
    """The rule token by token. ``q, k (B, H, L, Dk)``, ``v (B, H, L, Dv)``, ``g, beta (B, H, L)``,
    ``state (B, H, Dk, Dv)`` -> outputs ``(B, H, L, Dv)`` and the state after each token."""
    outputs, states = [], []
    for t in range(q.shape[2]):
        state = state * mx.exp(g[:, :, t])[..., None, None]
        k_t = k[:, :, t, :, None]  # (B, H, Dk, 1)
        remembered = (state * k_t).sum(axis=-2)  # S^T k: (B, H, Dv)
        delta = (v[:, :, t] - remembered) * beta[:, :, t, None]
        state = state + k_t * delta[:, :, None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(axis=-2))
        states.append(state)
    return mx.stack(outputs, axis=2), states


def unit_lower_inverse(m: mx.array) -> mx.array:
    """``(I + M)^-1`` for strictly lower-triangular ``M (..., C, C)``, C a power of two: M is
    nilpotent, so the inverse is ``sum_j (-M)^j = (I - M)(I + M^2)(I + M^4)...`` (log2 C
    matrix products, no sequential substitution)."""
    size = m.shape[-1]
    eye = mx.eye(size, dtype=m.dtype)
    power, inverse = -m, eye - m
    width = 2
    while width < size:
        power = power @ power
        inverse = inverse @ (eye + power)
        width *= 2
    return inverse


def default_chunk() -> int:
    """Tokens per chunk of the parallel form on MLX's default device."""
    return CPU_CHUNK if mx.default_device().type == mx.DeviceType.cpu else CHUNK


def chunked_delta_rule(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array, chunk: int | None = None
) -> tuple[mx.array, mx.array]:
    """The rule in chunks of ``chunk`` tokens (a power of two; default ``default_chunk()``;
    shapes as ``recurrent_delta_rule``) -> outputs ``(B, H, L, Dv)`` and the final state."""
    chunk = chunk or default_chunk()
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    pad = -L % chunk
    if pad:  # zero tokens at the end: g = 0, beta = 0 leave the state as it is
        q, k, v = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v))
        g, beta = (mx.pad(x, [(0, 0), (0, 0), (0, pad)]) for x in (g, beta))
    n = (L + pad) // chunk
    # (B, H, n * C, D) -> (B, H, n, C, D)
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = mx.cumsum(g, axis=-1)  # (B, H, n, C): log of the decay from the chunk start
    lower = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    pairwise = decay[..., :, None] - decay[..., None, :]  # (B, H, n, C, C): [i, j] = decay_i - decay_j
    pairwise = mx.where(lower, mx.exp(mx.where(lower, pairwise, 0.0)), 0.0)
    system = (k_beta @ k.swapaxes(-1, -2)) * pairwise  # the strictly lower part couples the tokens
    intra = (q @ k.swapaxes(-1, -2)) * pairwise  # (B, H, n, C, C): attention within the chunk
    solve = unit_lower_inverse(mx.where(mx.tril(lower, -1), system, 0.0))
    new_values = solve @ v_beta  # (B, H, n, C, Dv)
    k_cumdecay = solve @ (k_beta * mx.exp(decay)[..., None])  # (B, H, n, C, Dk)
    q_decayed = q * mx.exp(decay)[..., None]
    k_to_end = k * mx.exp(decay[..., -1:] - decay)[..., None]
    chunk_decay = mx.exp(decay[..., -1])[..., None, None]  # (B, H, n, 1, 1)
    outputs = []
    for i in range(n):
        fresh = new_values[:, :, i] - k_cumdecay[:, :, i] @ state  # (B, H, C, Dv)
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ fresh)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].swapaxes(-1, -2) @ fresh
    out = mx.stack(outputs, axis=2).reshape(B, H, n * chunk, Dv)  # (B, H, n, C, Dv) -> (B, H, n * C, Dv)
    return out[:, :, :L], state


def delta_rule(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array, keep: int
) -> tuple[mx.array, list[mx.array]]:
    """The rule over an update of L tokens: the recurrent form for the last ``keep`` and for
    short updates, the chunked form for the rest. Returns the outputs and the states at the last
    ``min(L, keep) + 1`` positions (the state before those tokens first, the final state last)."""
    recurrent = metal_recurrent_delta_rule if uses_kernel() else recurrent_delta_rule
    L = q.shape[2]
    tail = min(L, keep)
    head = L - tail
    outputs, states = [], [state]
    if head:
        split = [x[:, :, :head] for x in (q, k, v, g, beta)]
        if head >= MIN_CHUNKED:
            out, state = chunked_delta_rule(*split, state)
        else:
            out, steps = recurrent(*split, state)
            state = steps[-1]
        outputs, states = [out], [state]
    if tail:
        out, steps = recurrent(*(x[:, :, head:] for x in (q, k, v, g, beta)), state)
        outputs.append(out)
        states.extend(steps)
    return (mx.concatenate(outputs, axis=2) if len(outputs) > 1 else outputs[0]), states


class DepthwiseConv(nn.Module):
    """The causal depthwise conv1d, weight ``(channels, 1, kernel)`` as transformers stores it
    (``channels_last``: ``(channels, kernel, 1)``, mlx-lm's)."""

    def __init__(self, channels: int, kernel: int, channels_last: bool = False):
        super().__init__()
        self.weight = mx.zeros((channels, kernel, 1) if channels_last else (channels, 1, kernel))

    def __call__(self, x: mx.array) -> mx.array:
        """``x (B, kernel - 1 + L, C)``: the ``kernel - 1`` inputs before the update, then its own
        -> ``(B, L, C)``."""
        w = self.weight.reshape(self.weight.shape[0], -1).T  # (C, 1, K) or (C, K, 1) -> (K, C)
        kernel = w.shape[0]
        length = x.shape[1] - kernel + 1
        out = x[:, :length] * w[0]
        for j in range(1, kernel):
            out = out + x[:, j : j + length] * w[j]
        return out


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, scaled by ``weight`` (no offset), gated by ``silu(z)``."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, z: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x, self.weight, self.eps)
        return (normed * nn.silu(z.astype(mx.float32))).astype(x.dtype)


class GatedDeltaNet(nn.Module):
    """The mixer of a linear-attention layer: ``(B, L, hidden) -> (B, L, hidden)`` over a
    ``StateCache`` (None: a whole sequence from the zero state). Qwen3-Next stores the
    projections fused per key head (``in_proj_qkvz``, ``in_proj_ba``), Qwen3.5 split."""

    def __init__(self, args: ModelArgs, layer_index: int = 0):
        super().__init__()
        self.n_k, self.n_v = args.linear_num_key_heads, args.linear_num_value_heads
        self.d_k, self.d_v = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim, self.value_dim = self.n_k * self.d_k, self.n_v * self.d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = args.linear_conv_kernel_dim
        self.fused = args.linear_fused_projections
        hidden = args.hidden_size
        if self.fused:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.n_v, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.n_v, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.n_v, bias=False)
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel, args.linear_conv_channels_last)
        self.dt_bias = mx.ones((self.n_v,))
        self.A_log = mx.zeros((self.n_v,))
        self.norm = GatedRMSNorm(self.d_v, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``qkv (B, L, conv_dim)`` (all q heads, all k heads, all v heads), ``z (B, L, n_v, d_v)``,
        ``b, a (B, L, n_v)``."""
        B, L, _ = x.shape
        if not self.fused:
            z = self.in_proj_z(x).reshape(B, L, self.n_v, self.d_v)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        group = self.n_v // self.n_k  # value heads per key head
        # (B, L, n_k * (2 d_k + 2 group d_v)) -> (B, L, n_k, ...): each key head's q, k, v, z
        qkvz = self.in_proj_qkvz(x).reshape(B, L, self.n_k, -1)
        q, k, v, z = mx.split(qkvz, [self.d_k, 2 * self.d_k, 2 * self.d_k + group * self.d_v], axis=-1)
        ba = self.in_proj_ba(x).reshape(B, L, self.n_k, 2 * group)  # each key head's b, a
        b, a = ba[..., :group].reshape(B, L, self.n_v), ba[..., group:].reshape(B, L, self.n_v)
        qkv = mx.concatenate([t.reshape(B, L, -1) for t in (q, k, v)], axis=-1)
        return qkv, z.reshape(B, L, self.n_v, self.d_v), b, a

    def __call__(self, x: mx.array, mask: Mask, cache: Cache | None, rope_length: int | None = None) -> mx.array:
        """``cache``: a packed step's (``cache/packed.py``): the projections run once for every
        token, then each segment (a decode batch's rows, a prompt chunk) scans from its own state."""
        projected = self.project(x)
        if cache is None or cache.segments is None:
            return self.out_proj(self._mix(*projected, cache))
        cuts = [cut_tokens(t, cache.segments) for t in projected]
        parts = [self._mix(*inputs, segment.cache) for segment, *inputs in zip(cache.segments, *cuts)]
        return self.out_proj(join_tokens(parts, cache.segments))

    def _mix(self, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, cache: StateCache | None) -> mx.array:
        """The projected rows ``(B, L, ...)`` through the conv and the delta rule from ``cache``'s
        state (advanced), normed and gated: ``(B, L, value_dim)``."""
        B, L, _ = qkv.shape
        if cache is None:
            before = mx.zeros((B, self.kernel - 1, self.conv_dim), dtype=qkv.dtype)
            state = mx.zeros((B, self.n_v, self.d_k, self.d_v), dtype=mx.float32)
        else:
            before, state = cache.conv_window(self.kernel - 1, qkv), cache.recurrent(B, self.n_v, self.d_k, self.d_v)
        mixed = nn.silu(self.conv1d(mx.concatenate([before, qkv], axis=1)))  # (B, L, conv_dim)
        q, k, v = mx.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        group = self.n_v // self.n_k
        # (B, L, heads * d) -> (B, heads, L, d); q and k repeated to the value heads
        q = mx.repeat(q.reshape(B, L, self.n_k, self.d_k), group, axis=2).transpose(0, 2, 1, 3)
        k = mx.repeat(k.reshape(B, L, self.n_k, self.d_k), group, axis=2).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_v, self.d_v).transpose(0, 2, 1, 3).astype(mx.float32)
        q = l2_normalize(q.astype(mx.float32)) * self.d_k**-0.5
        k = l2_normalize(k.astype(mx.float32))
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + self.dt_bias.astype(mx.float32))
        beta = mx.sigmoid(b).astype(mx.float32)
        g, beta = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)  # (B, L, n_v) -> (B, n_v, L)
        out, states = delta_rule(q, k, v, g, beta, state, 0 if cache is None else cache.keep)
        if cache is not None:
            cache.advance(qkv, states)
        # (B, n_v, L, d_v) -> (B, L, n_v, d_v) -> (B, L, value_dim)
        out = self.norm(out.transpose(0, 2, 1, 3).astype(z.dtype), z)
        return out.reshape(B, L, -1)
