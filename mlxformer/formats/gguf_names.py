"""llama.cpp tensor names -> HF names: one explicit table with a ``{i}`` layer placeholder.

``TENSOR_NAMES`` holds the names every supported architecture shares; ``ARCH_TENSOR_NAMES``
adds or overrides rows for one ``general.architecture``. A GGUF tensor whose name has no row
is an error naming it (never a silent skip or a guessed name). To support a new architecture,
add its rows here and its metadata keys in ``gguf.config_from_metadata``.
"""

from __future__ import annotations

import re

from mlxformer.errors import MlxformerError

# llama.cpp name (without the ``.weight``/``.bias`` suffix) -> HF module name; {i}: layer index.
TENSOR_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
_SANDWICH_NORMS = {  # Gemma 2/3: four norms a layer
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
    "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
}


def _experts(block: str, shared: str = "shared_expert") -> dict[str, str]:
    """Mixture-of-experts rows: the router, the routed experts stored 3-D ``(experts, out, in)``
    as the stacked ``SwitchLinear`` weights, and Qwen2-MoE's gated shared expert (DeepSeek's
    ungated ``shared_experts``)."""
    prefix = f"model.layers.{{i}}.{block}"
    rows = {"blk.{i}.ffn_gate_inp": f"{prefix}.gate",
            "blk.{i}.ffn_gate_inp_shexp": f"{prefix}.shared_expert_gate"}
    for gguf_proj, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        rows[f"blk.{{i}}.ffn_{gguf_proj}_exps"] = f"{prefix}.switch_mlp.{proj}"
        rows[f"blk.{{i}}.ffn_{gguf_proj}_shexp"] = f"{prefix}.{shared}.{proj}"
    return rows


# DeepSeek-style experts (``models.router``): the sigmoid router's ``e_score_correction_bias``
# is llama.cpp's ``exp_probs_b``.
_ROUTED_EXPERTS = {**_experts("mlp", "shared_experts"),
                   "blk.{i}.exp_probs_b": "model.layers.{i}.mlp.gate.e_score_correction_bias"}


# Per-architecture rows, added to (or replacing) ``TENSOR_NAMES``.
ARCH_TENSOR_NAMES: dict[str, dict[str, str]] = {
    "llama": _experts("block_sparse_moe"),  # Mixtral is llama with ``ffn_*_exps``
    "qwen2": {}, "qwen3": {}, "gemma": {}, "granite": {}, "smollm3": {}, "mistral3": {},
    "qwen2moe": _experts("mlp"), "qwen3moe": _experts("mlp"), "olmoe": _experts("mlp"),
    "gemma2": _SANDWICH_NORMS,
    "gemma3": _SANDWICH_NORMS,
    "olmo2": {  # norms after the sublayers only
        "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
        "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
    },
    "gpt2": {  # learned positions, the fused qkv (the converter transposed GPT-2's Conv1D weights)
        "position_embd": "model.embed_positions",
        "blk.{i}.attn_qkv": "model.layers.{i}.self_attn.qkv_proj",
    },
    "phi3": {  # fused projections, as Phi-3 checkpoints store them
        "blk.{i}.attn_qkv": "model.layers.{i}.self_attn.qkv_proj",
        "blk.{i}.ffn_up": "model.layers.{i}.mlp.gate_up_proj",
    },
}
ARCH_TENSOR_NAMES["glm4moe"] = {"blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
                                **_ROUTED_EXPERTS}
ARCH_TENSOR_NAMES["deepseek2"] = {  # multi-head latent attention (``models.mla``)
    **{f"blk.{{i}}.attn_{gguf}": f"model.layers.{{i}}.self_attn.{hf}" for gguf, hf in (
        ("q_a", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b", "q_b_proj"),
        ("kv_a_mqa", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"), ("kv_b", "kv_b_proj"),
        # kv_b_proj split per head, as mlx-lm splits it: k_b (H, rank, nope), v_b (H, v, rank)
        # (``mla_layout.absorbed_kv_b`` joins them back); older files have the whole ``attn_kv_b``
        ("k_b", "embed_q"), ("v_b", "unembed_out"))},
    **_ROUTED_EXPERTS,
}
ARCH_TENSOR_NAMES["gpt-oss"] = {  # sinks, a biased router, biased experts (mlx-lm's names)
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_sinks": "model.layers.{i}.self_attn.sinks",
    "blk.{i}.ffn_gate_inp": "model.layers.{i}.mlp.router",
    **{f"blk.{{i}}.ffn_{p}_exps": f"model.layers.{{i}}.mlp.experts.{p}_proj" for p in ("gate", "up", "down")},
}
_DELTA = "model.layers.{i}.linear_attn"  # Gated DeltaNet (Qwen3.5, Qwen3-Next): ``gguf_hybrid`` undoes the converter's edits
_HYBRID = {
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_qkv": f"{_DELTA}.in_proj_qkv", "blk.{i}.attn_gate": f"{_DELTA}.in_proj_z",
    "blk.{i}.ssm_a": f"{_DELTA}.A_log", "blk.{i}.ssm_dt": f"{_DELTA}.dt_bias", "blk.{i}.ssm_conv1d": f"{_DELTA}.conv1d",
    "blk.{i}.ssm_norm": f"{_DELTA}.norm", "blk.{i}.ssm_out": f"{_DELTA}.out_proj",
}
_QWEN35 = {**_HYBRID, "blk.{i}.ssm_beta": f"{_DELTA}.in_proj_b", "blk.{i}.ssm_alpha": f"{_DELTA}.in_proj_a"}
ARCH_TENSOR_NAMES["qwen35"] = _QWEN35
ARCH_TENSOR_NAMES["qwen35moe"] = {**_QWEN35, **_experts("mlp")}
ARCH_TENSOR_NAMES["qwen3next"] = {**_HYBRID, **_experts("mlp"), "blk.{i}.ssm_ba": f"{_DELTA}.in_proj_ba"}
ARCH_TENSOR_NAMES["gemma4"] = {  # sandwich norms, the layer scalar, per-layer inputs, experts beside the MLP
    **_SANDWICH_NORMS,
    "blk.{i}.pre_ffw_norm_2": "model.layers.{i}.pre_feedforward_layernorm_2",
    "blk.{i}.post_ffw_norm_1": "model.layers.{i}.post_feedforward_layernorm_1",
    "blk.{i}.post_ffw_norm_2": "model.layers.{i}.post_feedforward_layernorm_2",
    "blk.{i}.ffn_gate_inp": "model.layers.{i}.router.proj",
    "blk.{i}.ffn_gate_inp.scale": "model.layers.{i}.router.scale",  # ``.scale`` tensors: rows of their own
    "blk.{i}.ffn_down_exps.scale": "model.layers.{i}.router.per_expert_scale",
    "blk.{i}.ffn_gate_up_exps": "model.layers.{i}.experts.gate_up_proj",  # HF's fused (E, 2I, H), split at load
    "blk.{i}.ffn_down_exps": "model.layers.{i}.experts.down_proj",
    "blk.{i}.layer_output_scale": "model.layers.{i}.layer_scalar",
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
    "blk.{i}.inp_gate": "model.layers.{i}.per_layer_input_gate",
    "blk.{i}.proj": "model.layers.{i}.per_layer_projection",
    "blk.{i}.post_norm": "model.layers.{i}.post_per_layer_input_norm",
}
# Parameters HF names without a ``.weight`` suffix (the converter added one, or wrote none:
# ``ssm_a``), and per architecture.
BARE_PARAMETERS = ("self_attn.sinks", "linear_attn.A_log", "linear_attn.dt_bias", "mlp.gate.e_score_correction_bias",
                   "layer_scalar")
ARCH_BARE_PARAMETERS = {"gemma4": ("router.scale", "router.per_expert_scale", "experts.gate_up_proj", "experts.down_proj")}
# Architectures whose Q/K rows llama.cpp's converter permuted (interleaved rotary pairs): its
# LlamaModel and the converters derived from it.
PERMUTED_QK_ARCHS = ("llama", "granite", "smollm3", "mistral3")
# Tensors that are config, not weights: read into the config by ``gguf.py``.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def is_block_from(gguf_name: str, first: int | None) -> bool:
    """Whether ``gguf_name`` is a tensor of block ``first`` or a later one (None: never)."""
    layer = _LAYER_NAME.match(gguf_name)
    return first is not None and layer is not None and int(layer.group(1)) >= first


# The multi-token-prediction block's own tensors (llama.cpp's ``nextn``; the converter's
# ``_QwenMtpMixin`` renames the hub's ``mtp.*`` to them) -> the hub's names, read as ``mtp.*``
# by ``mlxformer.speculative.mtp``; the block's other tensors are a decoder layer's, ``mtp.layers.{k}.*``.
NEXTN_NAMES: dict[str, str] = {
    "nextn.eh_proj": "mtp.fc",
    "nextn.enorm": "mtp.pre_fc_norm_embedding",
    "nextn.hnorm": "mtp.pre_fc_norm_hidden",
    "nextn.shared_head_norm": "mtp.norm",
}
# Architectures whose MTP blocks are read (as ``mtp.*``, beside the decoder); others' are skipped.
MTP_ARCHS = ("qwen35", "qwen35moe", "qwen3next")


def mtp_name(gguf_name: str, arch: str, first: int) -> str:
    """Map a tensor of MTP block ``first + k`` to the hub's name: ``blk.4.nextn.eh_proj.weight``
    to ``mtp.fc.weight``, ``blk.4.attn_q.weight`` to ``mtp.layers.0.self_attn.q_proj.weight``
    (``first`` 4); a name without a row raises."""
    layer = _LAYER_NAME.match(gguf_name)
    if layer is None or int(layer.group(1)) < first:
        raise MlxformerError(f"GGUF tensor {gguf_name!r} is not in a multi-token-prediction block")
    index, rest = int(layer.group(1)), layer.group(2)
    stem, _, suffix = rest.rpartition(".")
    if stem in NEXTN_NAMES and suffix == "weight":
        return f"{NEXTN_NAMES[stem]}.{suffix}"
    name = hf_name(gguf_name, arch)  # model.layers.{index}.*
    return f"mtp.layers.{index - first}." + name[len(f"model.layers.{index}."):]


def hf_name(gguf_name: str, arch: str) -> str:
    """Map e.g. ``blk.3.attn_q.weight`` to ``model.layers.3.self_attn.q_proj.weight``; a name
    without a row in the table raises."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):  # a name without a suffix (``blk.0.ssm_a``)
        stem, suffix = gguf_name, ""
    layer = _LAYER_NAME.match(stem)
    pattern, index = (f"blk.{{i}}.{layer.group(2)}", layer.group(1)) if layer else (stem, None)
    table = {**TENSOR_NAMES, **ARCH_TENSOR_NAMES.get(arch, {})}
    name = table[pattern].format(i=index) if pattern in table else ""  # Gemma 4's ``.scale`` rows: whole names
    bare = name.endswith(BARE_PARAMETERS + ARCH_BARE_PARAMETERS.get(arch, ()))
    if not name or not (suffix or bare):
        raise MlxformerError(f"GGUF tensor {gguf_name!r} has no mapping to this decoder (architecture {arch})")
    return name if bare else name + "." + suffix
