"""A tiny Llama that always answers one fixed word and stops: a bigram table written into the
weights (for the agent CLIs, which need a model whose reply is known).

Every attention and MLP output projection is zero, so the last hidden state is the current
token's embedding; the embeddings put each token in one of a few orthogonal directions (the
word's k-th token in direction k+1, every other token in direction 0), and the output head maps
direction 0 to the word's first token, direction k+1 to its next token and the last one to EOS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

WORD = "banana"
SCALE = 10.0
# added to every direction of these tokens' rows: strong enough to win over the 49k other tokens
# when sampled at temperature 1 (what agents send), weak against the word's SCALE
TIE_BREAKS = {'"': 2.0, "}": 1.8, "]": 1.8, ",": -0.5}


def write_word_model(directory: Path, tokenizer: Any, word: str = WORD, context: int = 131072) -> list[int]:
    """Save the model (float32, one layer) and ``tokenizer`` into ``directory``; returns the word's ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = tokenizer.encode(word, add_special_tokens=False)
    assert len(set(ids)) == len(ids), f"{word!r} repeats a token: the bigram table would be ambiguous"
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                         tie_word_embeddings=False, eos_token_id=eos, bos_token_id=eos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    hidden = config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        basis = torch.eye(hidden)
        model.model.embed_tokens.weight.copy_(basis[0].expand(config.vocab_size, hidden))
        for k, token in enumerate(ids):
            model.model.embed_tokens.weight[token] = basis[k + 1]
        model.model.norm.weight.fill_(1.0)
        head = model.lm_head.weight
        head.zero_()
        for k, token in enumerate([*ids, eos]):  # direction k (0: any other token) -> the next token
            head[token] = SCALE * basis[k]
        # under a grammar (a forced tool call) the word is not allowed: then the tie among the other
        # tokens is broken towards short JSON (close strings, objects and arrays; no whitespace)
        for text, bias in TIE_BREAKS.items():
            head[tokenizer.convert_tokens_to_ids(text)] += bias
        for token, text in enumerate(tokenizer.convert_ids_to_tokens(range(config.vocab_size))):
            if text and not text.strip("ĠĊĉčĉ \t\n\r"):  # whitespace pieces (byte-level spelling)
                head[token] -= 1.0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return ids
