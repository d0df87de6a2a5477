"""Flags shared by several commands, and their translation into the library's dataclasses.

Only ``argparse`` is imported at module level: building the parser (``mlxformer --help``)
must not import MLX, the tokenizers or jinja2. The library is imported when a command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxformer.cache import CacheSettings
    from mlxformer.errors import OptionError
    from mlxformer.sampling.model_defaults import SamplingDefaults
    from mlxformer.models.decoder import Model
    from mlxformer.sampling.options import SamplingSettings
    from mlxformer.speculative.speculator import SpeculativeSettings
    from mlxformer.text.tokenizer import Tokenizer

# The names of ``mlxformer.models.config.FLOAT_DTYPES`` (kept as strings: no MLX import here).
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """``--verbose`` on a subcommand (also accepted before the subcommand)."""
    parser.add_argument("--verbose", "-v", action="store_true", dest="verbose_sub", help="show tracebacks")


def add_model_args(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """``--model`` (repeatable when ``several``), ``--dtype``, ``--threads`` and ``--device-plan``."""
    parser.add_argument(
        "--model", "-m", action="append" if several else "store",
        help="HF repo id (REPO:QUANT picks a GGUF by quant tag), local HF/MLX dir or .gguf file "
             "(default: the offline SmolLM2-135M-Instruct)" + ("; repeat to serve several" if several else ""),
    )
    parser.add_argument(
        "--dtype", choices=DTYPE_NAMES,
        help="compute dtype for floating parameters (default: the checkpoint's; float32 for quantized models on CPU)",
    )
    parser.add_argument(
        "--threads", "-t", type=int, default=None,
        help="CPU streams to split each projection over (default: usable cores, at most 4, on CPU; 1 on GPU)",
    )
    parser.add_argument(
        "--device-plan", choices=("gpu", "cpu"), default=None,
        help="load as planned for this device (compute dtype, CPU streams) whatever MLX runs on (default: its device)",
    )
    parser.add_argument("--adapter", metavar="DIR",
                        help="apply this LoRA/DoRA adapter (mlx-lm's adapters.safetensors or PEFT's adapter_model.safetensors)")


def add_prompt_args(parser: argparse.ArgumentParser) -> None:
    """``--prompt``, ``--system`` and ``--ignore-chat-template``."""
    parser.add_argument("--prompt", "-p", required=True, help="the prompt; '-' reads it from stdin")
    parser.add_argument("--system", help="system message (with a chat template)")
    parser.add_argument("--ignore-chat-template", action="store_true", help="use the prompt raw, without the chat template")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """The sampling flags shared by generate and chat."""
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    # These five default to the model's generation_config.json (or GGUF sampling metadata), else
    # to the value in parentheses: the rule of mlxformer/sampling/model_defaults.py, shared with the server.
    parser.add_argument("--temp", type=float, default=None,
                        help="sampling temperature; 0 is greedy (default: the model's, else 0)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: the model's, else 1: off)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="keep the k most likely tokens (default: the model's, else 0: off)")
    parser.add_argument("--min-p", type=float, default=None,
                        help="min probability relative to the top token (default: the model's, else 0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="penalty on the last 64 tokens, e.g. 1.1 (default: the model's, else off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="subtracted once from each generated token's logit, in [-2, 2] (OpenAI's; default 0)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="subtracted per occurrence from each generated token's logit, in [-2, 2] (default 0)")
    parser.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)")
    parser.add_argument("--seed", type=int, default=None,
                        help="random seed for sampling, 0 to 2**64-1; -1 picks one (shown with --verbose)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """KV cache flags shared by generate, chat, cache-prompt and bench."""
    parser.add_argument("--kv-bits", type=int, choices=(4, 8), default=None, help="quantize the KV cache to 4 or 8 bits")
    parser.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64, help="KV quantization group (default 64)")
    parser.add_argument("--quantized-kv-start", type=int, default=0, help="quantize the cache once it holds this many tokens")
    parser.add_argument("--max-kv-size", type=int, default=None, help="keep at most this many tokens (rotating cache)")


def flag_error(exc: OptionError) -> OptionError:
    """``exc`` named as the command-line flag of its field (``top_p`` -> ``--top-p``)."""
    from mlxformer.errors import OptionError

    flag = "--" + exc.param.replace("_", "-")
    return OptionError(flag, exc.message)


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    """``--logit-bias ID=BIAS`` flags as ``{id: bias}`` (the values are checked by ``SamplingSettings``)."""
    from mlxformer.errors import OptionError

    bias: dict[int, float] = {}
    for item in items:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise OptionError("logit_bias", f"must be ID=BIAS, e.g. 42=-5 (got {item!r})") from None
    return bias


def sampling_settings(args: argparse.Namespace, defaults: SamplingDefaults | None = None) -> SamplingSettings:
    """The sampling dataclass from parsed flags, each unset one from the model's ``defaults``
    (``model_defaults.py``; none given: checks the flags alone, before the model loads). Errors
    name the flag. A random seed (``--seed -1``, or none while sampling) is drawn here and shown
    with ``--verbose``."""
    from mlxformer.errors import OptionError
    from mlxformer.sampling.model_defaults import NO_DEFAULTS

    try:
        bias = parse_logit_bias(args.logit_bias)
        settings = (defaults or NO_DEFAULTS).apply(
            temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, logit_bias=bias or None,
            seed=args.seed,
        )
    except OptionError as exc:
        raise flag_error(exc) from None
    if defaults is None:
        return settings
    if settings.seed == -1 or (settings.seed is None and not settings.greedy):
        settings = settings.seeded()
        if verbose(args):
            print(f"mlxformer: seed {settings.seed}", file=sys.stderr)
    return settings


def verbose(args: argparse.Namespace) -> bool:
    """Whether ``--verbose`` was given (before or after the subcommand)."""
    return bool(getattr(args, "verbose_sub", False) or getattr(args, "verbose", False))


def cache_settings(args: argparse.Namespace) -> CacheSettings:
    """The cache dataclass from parsed flags."""
    from mlxformer.cache import CacheSettings
    from mlxformer.errors import OptionError

    try:
        return CacheSettings(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                             quantized_kv_start=args.quantized_kv_start, max_kv_size=args.max_kv_size)
    except OptionError as exc:
        raise flag_error(exc) from None


def load_for_cli(args: argparse.Namespace) -> tuple[Model, Tokenizer]:
    """``load`` on ``--model`` (or the default model) with ``--dtype``, ``--threads`` and
    ``--device-plan``, carrying ``--adapter`` (on every forward) or serve's ``--lora`` adapters
    (for requests to choose), read before the model loads."""
    from mlxformer.adapters import attach_adapters, read_adapter
    from mlxformer.default_model import model_source
    from mlxformer.errors import MlxformerError
    from mlxformer.loader import load
    from mlxformer.models.config import FLOAT_DTYPES
    from mlxformer.models.device_plan import DevicePlan

    if args.threads is not None and args.threads < 1:
        raise MlxformerError("--threads must be at least 1")
    named = lora_flags(getattr(args, "lora", None) or []) or ({"adapter": args.adapter} if args.adapter else {})
    adapters = [read_adapter(path) for path in named.values()]
    model, tokenizer = load(model_source(args.model), dtype=FLOAT_DTYPES[args.dtype] if args.dtype else None,
                            threads=args.threads, plan=DevicePlan.named(args.device_plan))
    if adapters:
        attach_adapters(model, adapters, list(named), always_on=bool(args.adapter))
    return model, tokenizer


def lora_flags(items: list[str]) -> dict[str, str]:
    """``--lora NAME=DIR`` flags as ``{name: dir}`` (each name once)."""
    from mlxformer.errors import MlxformerError

    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path or ":" in name or name in out:
            raise MlxformerError(f"--lora takes NAME=DIR with a new name without ':', got {item!r}")
        out[name.strip()] = path
    return out


def check_output_path(path: str | Path) -> None:
    """Refuse, naming it, an output file path that is a directory or lies in a missing one."""
    from mlxformer.errors import MlxformerError

    path = Path(path)
    if path.is_dir():
        raise MlxformerError(f"{path} is a directory, not a file")
    if not path.parent.is_dir():
        raise MlxformerError(f"{path}: the directory {path.parent} does not exist")


def read_prompt(value: str) -> str:
    """The prompt text; ``-`` reads stdin. An empty prompt is an error."""
    from mlxformer.errors import MlxformerError

    text = sys.stdin.read() if value == "-" else value
    if not text.strip():
        raise MlxformerError("empty prompt")
    return text


def prompt_ids_for_cli(
    tokenizer: Tokenizer, prompt: str, args: argparse.Namespace, continue_final_message: bool = False
) -> list[int]:
    """Token ids of ``prompt`` with ``--system`` and ``--ignore-chat-template`` applied; with
    ``continue_final_message``, the user turn left open instead of followed by the assistant's."""
    use_template = not args.ignore_chat_template
    if args.system and not (use_template and tokenizer.chat_template):
        print("mlxformer: note: --system is ignored without a chat template", file=sys.stderr)
    return tokenizer.encode_prompt(prompt, args.system, use_template, continue_final_message=continue_final_message)


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """``--prompt-lookup``, ``--draft-model``, ``--mtp`` and ``--num-draft-tokens`` (alias ``--mtp-tokens``)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--prompt-lookup", action="store_true",
                       help="speculative decoding: propose the tokens that followed the last n-gram earlier in the text")
    group.add_argument("--draft-model", help="speculative decoding with this small model (same tokenizer)")
    group.add_argument("--mtp", nargs="?", const=True, default=False, metavar="FILE",
                       help="speculative decoding with the model's own multi-token-prediction head (Qwen3.5/3.6, "
                            "Qwen3-Next: an HF checkpoint's mtp.* weights, a GGUF's MTP block); FILE: the head from "
                            "a file of its own (llama.cpp's convert_hf_to_gguf.py --mtp output, mtp-*.gguf)")
    parser.add_argument("--num-draft-tokens", "--mtp-tokens", type=int, default=None, dest="num_draft_tokens",
                        help="most tokens proposed per step (default: 8 with --prompt-lookup, 4 with --draft-model, "
                             "2 with --mtp)")


def speculates(args: argparse.Namespace) -> bool:
    """Whether the flags ask for speculative decoding."""
    return bool(args.prompt_lookup or args.draft_model or args.mtp)


def speculative_settings(args: argparse.Namespace, tokenizer: Tokenizer, model: Model | None = None
                         ) -> SpeculativeSettings | None:
    """The speculative settings from flags (loading ``--draft-model``, or ``--mtp``'s head of
    ``model`` from ``--model``, from ``--mtp FILE``, or from a ``--draft-model`` GGUF with an MTP
    block, as llama.cpp's ``-md`` takes one), or None."""
    from mlxformer.default_model import model_source
    from mlxformer.errors import MlxformerError, OptionError
    from mlxformer.loader import load
    from mlxformer.models.config import FLOAT_DTYPES
    from mlxformer.models.device_plan import DevicePlan
    from mlxformer.speculative.speculator import SpeculativeSettings

    if not speculates(args):
        if args.num_draft_tokens is not None:
            raise MlxformerError("--num-draft-tokens needs --prompt-lookup, --draft-model or --mtp")
        return None
    from mlxformer.speculative.mtp import has_mtp_block, load_mtp

    # --mtp FILE, or a GGUF with an MTP block as --draft-model (llama.cpp's -md drafts with its head)
    mtp_file = args.draft_model if has_mtp_block(args.draft_model) else args.mtp if isinstance(args.mtp, str) else None
    default = 8 if args.prompt_lookup else 2 if args.mtp or mtp_file else 4
    count = default if args.num_draft_tokens is None else args.num_draft_tokens
    try:
        if args.prompt_lookup:
            return SpeculativeSettings(num_draft_tokens=count, prompt_lookup=True)
        SpeculativeSettings(num_draft_tokens=count, prompt_lookup=True)  # the flags' values, before loading
    except OptionError as exc:
        raise flag_error(exc) from None
    if args.mtp or mtp_file:
        assert model is not None, "--mtp needs the loaded model"
        source = mtp_file or model_source(args.model)
        return SpeculativeSettings(num_draft_tokens=count, mtp=load_mtp(source, model))
    draft, draft_tokenizer = load(args.draft_model, dtype=FLOAT_DTYPES[args.dtype] if args.dtype else None,
                                  threads=args.threads, plan=DevicePlan.named(args.device_plan))
    return SpeculativeSettings(num_draft_tokens=count, draft_model=draft, draft_tokenizer=draft_tokenizer)
