"""The process group: started by ``mlx.launch`` (ring over TCP, JACCL or MPI as available)."""

from __future__ import annotations

import mlx.core as mx

from mlxformer.errors import MlxformerError

PARALLEL_MODES = ("pipeline", "tensor")


def init_group() -> mx.distributed.Group:
    """The group this process was launched in; a clear error when not launched by ``mlx.launch``."""
    try:
        return mx.distributed.init(strict=True)
    except (RuntimeError, ValueError) as exc:
        raise MlxformerError(
            f"cannot join a distributed group ({str(exc).strip().splitlines()[0] if str(exc).strip() else exc}); "
            "start every rank with mlx.launch, e.g. 'mlx.launch --backend ring -n 2 -- mlxformer generate ...'"
        ) from None


def is_leader(group: mx.distributed.Group) -> bool:
    """Whether this rank is the one that prints (rank 0)."""
    return group.rank() == 0


def shared_seed(group: mx.distributed.Group, seed: int | None) -> int:
    """The same sampling seed on every rank: ``seed`` if given, else one chosen by rank 0."""
    if seed is not None:
        return seed
    import random

    mine = random.randrange(1 << 30) if is_leader(group) else 0
    total = mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=group)
    return int(total.item())
