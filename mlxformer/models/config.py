"""The frozen model configuration that drives the one decoder.

Every supported family (Llama 1-3.2, Mistral, Qwen2/2.5, Qwen3, SmolLM, TinyLlama, Gemma 1-3,
Phi-3/3.5/4, Granite, OLMo 2, SmolLM3, GPT-2...) is a set of field values here, read from an HF
``config.json`` dict (``models.families`` maps each family's keys) or from GGUF metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxformer.errors import MlxformerError
from mlxformer.models.config_bounds import check_config_sizes
from mlxformer.models.family_keys import activation
from mlxformer.models.families import FAMILIES, family_fields, head_config, head_fields, hybrid_config, text_config_of
from mlxformer.models.gemma4_family import gemma4_config
from mlxformer.models.rope_config import SUPPORTED_ROPE_TYPES, RopeConfig, rope_config_from_dict, rope_scaling_dict

__all__ = ["FLOAT_DTYPES", "float_dtype", "ModelArgs", "RopeConfig", "SUPPORTED_ROPE_TYPES", "rope_config_from_dict", "rope_scaling_dict"]

# Floating dtypes users may name on the command line or in the API.
FLOAT_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def float_dtype(value: "str | mx.Dtype | None", what: str = "dtype") -> mx.Dtype | None:
    """A floating dtype given by name (``"bfloat16"``) or as an ``mx.Dtype``; None stays None."""
    if value is None or value in FLOAT_DTYPES.values():
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value in FLOAT_DTYPES:
        return FLOAT_DTYPES[value]
    raise MlxformerError(f"unsupported {what} {value!r} (choose from {', '.join(FLOAT_DTYPES)})")

# Keys of a config.json that change the math but that this decoder does not implement.
_UNSUPPORTED_TRUE_FLAGS = ("use_sliding_window",)


@dataclass(frozen=True)
class ModelArgs:
    """Shape and behaviour of a LLaMA-style decoder."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int  # the dense MLP's width (0: the config gives none, no layer has a dense MLP)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # --- family switches; the defaults are Llama's ---
    hidden_act: str = "silu"  # the MLP gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    mlp_type: str = "dense"  # a key of ``models.feed_forward.MLP_TYPES``
    fused_qkv: bool = False  # one ``qkv_proj`` (Phi-3) instead of q/k/v projections
    fused_gate_up: bool = False  # one ``gate_up_proj`` (Phi-3) instead of gate/up projections
    norm_type: str = "rms"  # "rms" (RMSNorm) or "layer" (LayerNorm with a bias, GPT-2): ``models.norms.make_norm``
    position_type: str = "rope"  # "rope", or "learned": absolute positions added to the embeddings (GPT-2's wpe)
    gated_mlp: bool = True  # down(act(gate(x)) * up(x)); False: down(act(up(x))) (GPT-2)
    norm_offset: float = 0.0  # RMSNorm scales by ``norm_offset + weight`` (Gemma: 1)
    norm_layout: str = "pre"  # a key of ``models.norms.NORM_LAYOUTS``: pre, sandwich (Gemma 2/3), post (OLMo 2)
    qk_norm_scope: str = "head"  # q/k RMSNorm per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2)
    attention_scale: float | None = None  # None: head_dim**-0.5 (Gemma: query_pre_attn_scalar**-0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    # Per layer "sliding" or "full" (Gemma 2/3); empty: every layer uses ``sliding_window``.
    layer_types: tuple[str, ...] = ()
    rope_local: RopeConfig | None = None  # the RoPE of sliding layers, when it differs (Gemma 3)
    rope_layers: tuple[bool, ...] = ()  # per layer, whether it applies RoPE (SmolLM3); empty: all do
    partial_rotary_factor: float = 1.0  # the share of each head's features that is rotated
    embedding_scale: float = 1.0  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_scale: float = 1.0  # Granite: each sublayer's output is scaled before the residual add
    logits_scale: float = 1.0  # Granite: 1 / logits_scaling
    # Ministral 3 (Llama 4's scaling): queries at position p are multiplied by
    # ``1 + beta * log(1 + floor(p / length))`` after RoPE (beta 0: off).
    query_scale_beta: float = 0.0
    query_scale_length: int = 1
    # --- mixture of experts (``mlp_type="moe"``, ``models.moe``) ---
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's hidden size
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    decoder_sparse_step: int = 1  # every n-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense
    mlp_name: str = "mlp"  # the block's attribute, as the checkpoint names it (Mixtral: block_sparse_moe)
    # --- gpt-oss ---
    attention_sinks: bool = False  # a learned per-head logit joins each attention softmax
    # DeepSeek-style routing (``models.router``): "softmax" is the plain softmax top-k of an
    # ``nn.Linear`` gate; "greedy", "group_limited_greedy" (DeepSeek-V2) and "noaux_tc" (V3, GLM)
    # the grouped router with ``n_group`` groups of which ``topk_group`` compete.
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0  # ungated shared experts, moe_intermediate_size each (DeepSeek, GLM)
    # --- multi-head latent attention (``attention_type="mla"``, ``models.mla``) ---
    attention_type: str = "gqa"
    q_lora_rank: int | None = None  # None: a plain q_proj
    kv_lora_rank: int = 0  # the cached latent's size
    qk_rope_head_dim: int = 0  # rotated features per head (the cached rope key's size)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_traditional: bool = False  # RoPE rotates interleaved pairs (DeepSeek's layout)
    # --- Gated DeltaNet layers (``layer_types`` entry "linear", ``models.gated_delta``: Qwen3.5, Qwen3-Next) ---
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    linear_fused_projections: bool = False  # Qwen3-Next's in_proj_qkvz/in_proj_ba (Qwen3.5: split)
    linear_conv_channels_last: bool = False  # conv1d weight (C, K, 1) as mlx-lm stores it (HF: (C, 1, K))
    attn_output_gate: bool = False  # q_proj also gives a sigmoid gate on the attention output (Qwen3.5/Next)
    mtp_layers: int = 0  # multi-token-prediction layers stored after the decoder's (unused, dropped)
    # --- Gemma 4 (``models.gemma4_family``, ``models.gemma4``) ---
    global_head_dim: int = 0  # the head size of "full" layers (0: head_dim)
    global_kv_heads: int = 0  # the K/V heads of "full" layers (0: num_key_value_heads)
    attention_k_eq_v: bool = False  # "full" layers have no v_proj: the values are the keys' projection
    v_norm: bool = False  # values pass a scale-free RMSNorm per head
    layer_scalar: bool = False  # each layer's output is multiplied by its stored ``layer_scalar``
    hidden_size_per_layer_input: int = 0  # per-layer token inputs of this size (0: none)
    vocab_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0  # the last layers attend over an earlier layer's keys/values (``kv_source``)
    double_wide_mlp: bool = False  # the KV-shared layers' MLP is twice ``intermediate_size``
    experts_beside_mlp: bool = False  # a routed experts block beside the dense MLP (Gemma 4's MoE)
    # --- embedding and scoring models (``mlxformer.embeddings``) ---
    bidirectional: bool = False  # every token attends to every other (EmbeddingGemma); sliding layers to |i-j| <= window // 2
    head: str = "lm"  # "lm": vocabulary logits; "none": hidden states only (a base model); "score": a ``score`` classifier
    num_labels: int = 0  # the ``score`` head's outputs

    def layer_window(self, index: int) -> int | None:
        """The sliding window layer ``index`` attends with (None: the whole context)."""
        if not self.layer_types or self.layer_types[index] == "sliding":
            return self.sliding_window
        return None

    def check_positions(self, prompt: int, max_tokens: int) -> None:
        """Raise when a prompt of ``prompt`` tokens and ``max_tokens`` generated ones pass the
        learned positions (GPT-2's ``n_positions``; the last generated token is never fed back,
        so they take one position fewer); rotary positions have no end."""
        tokens = prompt + max_tokens - 1
        if self.position_type == "learned" and tokens > self.max_position_embeddings:
            raise MlxformerError(f"the prompt and max_tokens need {tokens} positions; this model has "
                                 f"{self.max_position_embeddings} (learned positions)")

    def layer_is_linear(self, index: int) -> bool:
        """Whether layer ``index`` mixes with Gated DeltaNet (a recurrent state) instead of attention."""
        return bool(self.layer_types) and self.layer_types[index] == "linear"

    def layer_rope(self, index: int) -> RopeConfig | None:
        """The RoPE settings of layer ``index`` (None: the layer has no rotary embedding)."""
        if self.position_type == "learned" or (self.rope_layers and not self.rope_layers[index]):
            return None
        if self.rope_local is not None and self.layer_types and self.layer_types[index] == "sliding":
            return self.rope_local
        return self.rope

    def layer_is_global(self, index: int) -> bool:
        """Whether layer ``index`` is a "full" layer of a model with per-type head sizes (Gemma 4)."""
        return bool(self.global_head_dim) and self.layer_types[index] == "full"

    def layer_head_dim(self, index: int) -> int:
        """The head size of layer ``index``'s attention."""
        return self.global_head_dim if self.layer_is_global(index) else self.head_dim

    def layer_kv_heads(self, index: int) -> int:
        """The K/V head count of layer ``index``'s attention."""
        return self.global_kv_heads if self.layer_is_global(index) else self.num_key_value_heads

    def kv_source(self, index: int) -> int | None:
        """The earlier layer whose keys/values layer ``index`` attends over (Gemma 4's last
        ``num_kv_shared_layers``: the last unshared layer of the same type); None: its own."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if index < first_shared:
            return None
        return max(i for i in range(first_shared) if self.layer_types[i] == self.layer_types[index])

    def cache_dims(self, index: int = 0) -> tuple[int, int, int]:
        """What layer ``index``'s cache stores per token: ``(heads, key dims, value dims)``; an
        MLA layer stores one rope key and one latent (``cache.latent``)."""
        if self.attention_type == "mla":
            return 1, self.qk_rope_head_dim, self.kv_lora_rank
        return self.layer_kv_heads(index), self.layer_head_dim(index), self.layer_head_dim(index)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        """Build the args from an HF/mlx-lm ``config.json`` dict; unsupported settings raise."""
        config = text_config_of(config)
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise MlxformerError(f"unsupported model_type {model_type!r} (supported: {', '.join(FAMILIES)})")
        for flag in _UNSUPPORTED_TRUE_FLAGS:
            if config.get(flag):
                raise MlxformerError(f"unsupported config setting {flag}=true for {model_type}")
        check_config_sizes(config)  # before any per-layer or per-expert table is built
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            head_dim = config.get("head_dim") or hidden // heads
            attention_bias = bool(config.get("attention_bias", False))
            fields: dict[str, Any] = dict(
                model_type=model_type,
                hidden_size=hidden,
                num_hidden_layers=int(config["num_hidden_layers"]),
                intermediate_size=int(config.get("intermediate_size") or 0),  # 0: no dense MLP (models.mlp)
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                vocab_size=int(config["vocab_size"]),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=rope_config_from_dict(config),
                max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                # Llama-style ``attention_bias`` covers all four projections.
                qkv_bias=attention_bias,
                o_proj_bias=attention_bias,
                mlp_bias=bool(config.get("mlp_bias", False)),
                bidirectional=bool(config.get("use_bidirectional_attention", False)),
                **head_fields(config),
            )
            fields.update(family_fields(config, fields))
            if "hidden_act" not in fields:  # a family that reads no activation of its own: its config's gate
                fields["hidden_act"] = activation(config, "silu", "hidden_act")
            return cls(**fields)
        except KeyError as exc:
            raise MlxformerError(f"config.json is missing required key {exc.args[0]!r}") from None

    def to_dict(self) -> dict[str, Any]:
        """An HF-style ``config.json`` dict that ``from_dict`` reads back to equal args."""
        config: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": [ARCHITECTURES[self.model_type]],
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            **({"intermediate_size": self.intermediate_size} if self.intermediate_size else {}),  # 0: no dense MLP
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling_dict(self.rope),
            "hidden_act": "silu" if self.hidden_act == "silu" else "gelu_pytorch_tanh",
        }
        if self.head != "lm" or self.bidirectional:
            config.update(head_config(self, ARCHITECTURES[self.model_type]))
        if self.model_type != "qwen2":  # Llama's covers all four projections; GLM-4.5's only q/k/v
            config["attention_bias"] = self.qkv_bias or self.o_proj_bias
        config["mlp_bias"] = self.mlp_bias
        if self.model_type == "gpt2":  # its other switches follow from the model type
            config["scale_attn_weights"] = self.attention_scale is None
        if self.sliding_window is not None:
            config["sliding_window"] = self.sliding_window
        config.update(self._layer_and_rope_keys())
        if self.linear_num_value_heads:
            config.update(hybrid_config(self))
        if self.attention_type == "mla" and config["rope_scaling"] is None:  # mlx-lm's DeepSeek-V2 reads its factor
            config["rope_scaling"] = {"rope_type": "default", "type": "default", "factor": 1.0}
        if self.global_head_dim:  # Gemma 4: RoPE per layer type only (transformers refuses a flat one)
            config.update(gemma4_config(self))
            del config["rope_theta"], config["rope_scaling"]
        if self.num_experts:
            config.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                          num_experts_per_tok=self.num_experts_per_tok, norm_topk_prob=self.norm_topk_prob,
                          moe_intermediate_size=self.moe_intermediate_size,
                          shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                          decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
        return config

    def _layer_and_rope_keys(self) -> dict[str, Any]:
        """The per-layer and RoPE keys mlx-lm's readers need beyond ``rope_theta``/``rope_scaling``."""
        keys: dict[str, Any] = {}
        if self.layer_types:
            keys["layer_types"] = [f"{t}_attention" for t in self.layer_types]
        if self.partial_rotary_factor != 1.0:
            keys["partial_rotary_factor"] = self.partial_rotary_factor
        if self.rope.type == "longrope":  # Phi-3: the switch point at the top level
            keys["original_max_position_embeddings"] = self.rope.original_max_position_embeddings
        if self.query_scale_beta:  # Ministral 3: transformers' and mlx-lm's one rope_parameters dict
            keys["rope_parameters"] = {"rope_theta": self.rope.theta, **(rope_scaling_dict(self.rope) or {}),
                                       "llama_4_scaling_beta": self.query_scale_beta,
                                       "original_max_position_embeddings": self.query_scale_length}
        return keys


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
