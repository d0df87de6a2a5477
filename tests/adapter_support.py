"""Adapters for the adapter tests and benchmark, written by their own tools: PEFT LoRA/DoRA
trained a few steps (so B is not zero) and mlx-lm's LoRA layers saved in its layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def train_peft_adapter(base_dir: Path, out_dir: Path, seed: int = 0, steps: int = 3, **lora: Any):
    """Train a PEFT adapter (``LoraConfig(**lora)``) on the transformers model in ``base_dir``
    for ``steps`` Adam steps on random tokens and save it (safetensors) in ``out_dir``; returns
    the PEFT model (float32, eval mode, unmerged)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **lora))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    tokens = torch.randint(0, base.config.vocab_size, (2, 16))
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def write_mlx_lm_adapter(base_dir: Path, out_dir: Path, seed: int = 0, rank: int = 4, scale: float = 2.0,
                         dora: bool = False, keys: list[str] | None = None) -> None:
    """mlx-lm's own LoRA (or DoRA) layers on its load of ``base_dir`` (``linear_to_lora_layers``),
    ``lora_b`` (and DoRA's ``m``) given random values, saved as ``mlx_lm.lora`` saves them:
    the trainable parameters in ``adapters.safetensors`` and the config beside."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(base_dir))
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0,
              "keys": keys or ["self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj"]}
    layers = len(model.layers)
    linear_to_lora_layers(model, layers, params, use_dora=dora)
    mx.random.seed(seed)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    model.update(__import__("mlx.utils", fromlist=["tree_unflatten"]).tree_unflatten([
        (k, mx.random.normal(v.shape) * 0.1 + (v if k.endswith(".m") else 0)) if not k.endswith("lora_a") else (k, v)
        for k, v in trainable.items()]))
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = {"fine_tune_type": "dora" if dora else "lora", "num_layers": layers, "lora_parameters": params}
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
