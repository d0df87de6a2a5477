"""The recurrent (token by token) gated delta rule as one Metal kernel (``mx.fast.metal_kernel``),
used by ``gated_delta.delta_rule`` when MLX's default device is a Metal GPU; every other device
runs ``gated_delta.recurrent_delta_rule`` (MLX ops), which computes the same thing.

One thread per value feature ``j`` of one (batch row, head): it holds column ``j`` of the state
``S (Dk, Dv)`` in registers and, for each token,

    S[:, j] *= exp(g);   delta = beta * (v[j] - S[:, j] . k);   S[:, j] += k * delta;   o[j] = S[:, j] . q

writing ``o[j]`` and the column after the token (the cache keeps the states of the last tokens).
No thread reads another's column, so there is no reduction across threads. All in float32.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

SOURCE = """
    uint j = thread_position_in_grid.x;   // the value feature (column of the state)
    uint row = thread_position_in_grid.y; // batch row * heads + head
    float s[Dk];
    for (int i = 0; i < Dk; ++i) {
        s[i] = state[(row * Dk + i) * Dv + j];
    }
    for (int t = 0; t < T; ++t) {
        uint tok = row * T + t;  // (B * H, T) flattened
        float decay = metal::exp(g[tok]);
        float remembered = 0.0f;
        for (int i = 0; i < Dk; ++i) {
            s[i] *= decay;
            remembered += s[i] * k[tok * Dk + i];
        }
        float delta = (v[tok * Dv + j] - remembered) * beta[tok];
        float out = 0.0f;
        for (int i = 0; i < Dk; ++i) {
            s[i] += k[tok * Dk + i] * delta;
            out += s[i] * q[tok * Dk + i];
        }
        y[tok * Dv + j] = out;
        for (int i = 0; i < Dk; ++i) {
            states[(tok * Dk + i) * Dv + j] = s[i];
        }
    }
"""


@lru_cache(maxsize=1)
def _kernel() -> object:
    """The compiled kernel (built once: each build makes a new Metal library)."""
    return mx.fast.metal_kernel(
        name="mlxformer_gated_delta_step",
        input_names=["q", "k", "v", "g", "beta", "state"],
        output_names=["y", "states"],
        source=SOURCE,
    )


def uses_kernel() -> bool:
    """Whether the recurrent rule runs the Metal kernel: MLX's default device is a Metal GPU."""
    return mx.metal.is_available() and mx.default_device().type == mx.DeviceType.gpu


def metal_recurrent_delta_rule(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, list[mx.array]]:
    """``recurrent_delta_rule`` in one kernel launch: ``q, k (B, H, L, Dk)``, ``v (B, H, L, Dv)``,
    ``g, beta (B, H, L)``, ``state (B, H, Dk, Dv)`` (float32) -> outputs ``(B, H, L, Dv)`` and
    the state after each token."""
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    f32 = [x.astype(mx.float32) for x in (q, k, v, g, beta, state)]
    y, states = _kernel()(  # type: ignore[operator]
        inputs=f32,
        template=[("Dk", Dk), ("Dv", Dv), ("T", L)],
        grid=(Dv, B * H, 1),
        threadgroup=(min(Dv, 32), 1, 1),
        output_shapes=[(B, H, L, Dv), (B, H, L, Dk, Dv)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return y, [states[:, :, t] for t in range(L)]
