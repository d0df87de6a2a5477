"""``mlxformer info``: what a model needs (parameters, weight and KV-cache memory, machines),
from its config and tensor headers only."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from mlxformer.cli.common import add_verbose

if TYPE_CHECKING:
    from mlxformer.tools.planning import Footprint


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``info`` subcommand."""
    parser = subparsers.add_parser(
        "info", help="parameters, memory and machines a model needs (reads headers only)",
        description="Parameter count, weight memory per dtype/quantization, KV-cache bytes and how many "
                    "machines like this one a pipeline needs. Reads the config and tensor headers, never the weights.",
    )
    parser.add_argument("--model", "-m", help="HF repo id, local HF/MLX dir or .gguf file (default: the offline SmolLM2)")
    parser.add_argument("--context", type=int, default=4096, help="tokens of KV cache to plan for (default 4096)")
    parser.add_argument("--device-plan", choices=("gpu", "cpu"), default=None,
                        help="the device the sizes are planned for (default: MLX's; both plans are listed)")
    add_verbose(parser)
    parser.set_defaults(handler=run)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _dtype_name(fp: Footprint) -> str:
    return str(fp.plan.compute).rpartition(".")[2]


def plan_lines(plans: dict[str, Footprint], current: str) -> list[str]:
    """One line per device plan: its compute dtype, CPU streams and prefill chunk."""
    from mlxformer.models.device_plan import DevicePlan

    lines = ["device plans:"]
    for kind, fp in plans.items():
        plan = DevicePlan(kind)
        mark = "  (this device)" if kind == current else ""
        lines.append(f"  {kind}  {_dtype_name(fp)} compute, {plan.threads} CPU stream(s) per projection, "
                     f"prefill chunks of {plan.prefill_step}{mark}")
    return lines


def format_report(fp: Footprint, context: int, memory: int) -> str:
    """The ``info`` report as text."""
    from mlxformer.tools.planning import KV_BITS, KV_GROUP_SIZE, WEIGHT_BITS, WEIGHT_GROUP_SIZE, ranks_needed

    a = fp.args
    lines = [
        f"model: {a.model_type}, {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
        f"{a.num_attention_heads} heads / {a.num_key_value_heads} KV heads of {a.head_dim}, vocab {a.vocab_size}",
        f"parameters: {fp.parameters:,} exact; {fp.estimate:,} by 12*L*d^2 + embedding "
        f"({fp.estimate / fp.parameters:.2f}x)"
        + (f"; {fp.active_parameters:,} active per token ({a.num_experts_per_tok} of {a.num_experts} experts)"
           if a.num_experts else ""),
        f"weights as stored: {_size(fp.stored_bytes)}; as loaded here: {_size(fp.loaded_bytes)} "
        f"({_dtype_name(fp)} compute)",
        "weight memory:",
        f"  float32  {_size(fp.weight_bytes(32))}",
        f"  16-bit   {_size(fp.weight_bytes(16))}  (float16 / bfloat16)",
    ]
    lines += [f"  {bits}-bit    {_size(fp.weight_bytes(bits))}  (group {WEIGHT_GROUP_SIZE})" for bits in WEIGHT_BITS]
    act = fp.activation_bytes
    lines.append(f"KV cache ({8 * act}-bit activations on this device), per token / at {context:,} tokens:")
    for label, bits in (("float", None), *((f"{b}-bit", b) for b in KV_BITS)):
        suffix = "" if bits is None else f"  (group {KV_GROUP_SIZE})"
        lines.append(f"  {label:<7}  {_size(fp.kv_bytes_per_token(bits))} / {_size(fp.kv_bytes(context, bits))}{suffix}")
    needed = fp.loaded_bytes + fp.kv_bytes(context)
    ranks = ranks_needed(needed, memory)
    verdict = "fits on this machine" if ranks == 1 else f"needs a pipeline of {ranks} machines like this one"
    lines.append(
        f"this machine: {_size(memory)}; weights as loaded + float KV at {context:,} tokens = {_size(needed)}: {verdict}"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer info``."""
    from mlxformer.default_model import model_source
    from mlxformer.errors import MlxformerError
    from mlxformer.formats.checkpoint import open_checkpoint
    from mlxformer.sampling.model_defaults import SamplingDefaults
    from mlxformer.tools.planning import footprint, machine_memory

    if args.context < 1:
        raise MlxformerError("--context must be positive")
    from mlxformer.models.device_plan import KINDS, DevicePlan

    checkpoint = open_checkpoint(model_source(args.model))
    print(f"path: {checkpoint.path}" + ("" if args.model else "  (the default model: no --model given)"))
    plans = {kind: footprint(checkpoint, DevicePlan(kind).device) for kind in KINDS}
    kind = DevicePlan.named(args.device_plan).kind
    print(format_report(plans[kind], args.context, machine_memory()))
    print("\n".join(plan_lines(plans, DevicePlan.current().kind)))
    defaults = SamplingDefaults.of_checkpoint(checkpoint.tokenizer_dir, checkpoint.gguf_metadata)
    print(f"sampling defaults (unless a flag or request sets them): {defaults.describe()}")
    return 0
