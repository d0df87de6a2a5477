"""Tiny embedding and reranker checkpoints written by transformers' and sentence-transformers'
own classes (random weights made O(1) by ``perturb_``), over a byte-level tokenizer.

- ``write_qwen3_embedding``: a ``Qwen3Model`` saved as sentence-transformers saves
  Qwen3-Embedding: last-token pooling, Normalize, its query instruction as the "query" prompt,
  an end-of-text token appended by the tokenizer, left padding.
- ``write_embedding_gemma``: a ``Gemma3TextModel`` with bidirectional attention (sliding window 8)
  saved as EmbeddingGemma is: mean pooling, two Dense projections, Normalize, its task prompts.
- ``write_qwen3_reranker``: a ``Qwen3ForCausalLM`` whose vocabulary has "yes" and "no" tokens;
  ``write_cross_encoder``: a ``Qwen3ForSequenceClassification`` with one label.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import write_tiny_checkpoint

QWEN3_QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
GEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}
EOT = 1  # the end-of-text id the Qwen3-Embedding-style tokenizer appends
TEXTS = ["hello world", "hi", "a much longer sentence, past the sliding window of eight tokens, to pool",
         "x", "Quels sont les meilleurs fromages ?"]


def write_tokenizer(directory: Path, append_eot: bool = False, padding_side: str = "right") -> None:
    """Latin-1 characters as ids 0..255 plus the added tokens "yes" (256) and "no" (257); with
    ``append_eot`` every encoding ends with id 1, as Qwen3-Embedding's tokenizer appends <|endoftext|>."""
    from tokenizers import Tokenizer, models, processors

    tokenizer = Tokenizer(models.BPE(vocab={chr(i): i for i in range(256)}, merges=[]))
    tokenizer.add_tokens(["yes", "no"])
    if append_eot:
        tokenizer.post_processor = processors.TemplateProcessing(single="$A \x01", special_tokens=[("\x01", EOT)])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "\x00", "eos_token": "\x01",
              "padding_side": padding_side}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _base_model(directory: Path, model_type: str, seed: int, **config: Any) -> Any:
    from transformers import AutoModel

    return write_tiny_checkpoint(directory, model_type, seed, AutoModel, **{"vocab_size": 260, "head_dim": 16, **config})[1]


def _save_sentence_transformer(transformer_dir: Path, out: Path, modules: list[Any], prompts: dict[str, str]) -> Path:
    from sentence_transformers import SentenceTransformer, models

    model = SentenceTransformer(modules=[models.Transformer(str(transformer_dir)), *modules], prompts=prompts,
                                device="cpu")
    model.save(str(out))
    return out


def write_qwen3_embedding(root: Path, seed: int = 0) -> Path:
    """A Qwen3-Embedding-shaped sentence-transformers dir under ``root``."""
    from sentence_transformers import models

    base = root / "qwen3_base"
    base.mkdir()
    _base_model(base, "qwen3", seed)
    write_tokenizer(base, append_eot=True, padding_side="left")
    return _save_sentence_transformer(base, root / "qwen3_embedding", [models.Pooling(64, "lasttoken"), models.Normalize()],
                                      {"query": QWEN3_QUERY_PROMPT, "document": ""})


def write_embedding_gemma(root: Path, seed: int = 1) -> Path:
    """An EmbeddingGemma-shaped sentence-transformers dir under ``root``."""
    import torch
    from sentence_transformers import models

    base = root / "gemma_base"
    base.mkdir()
    _base_model(base, "gemma3_text", seed, use_bidirectional_attention=True, sliding_window=8,
                query_pre_attn_scalar=16)
    write_tokenizer(base)
    torch.manual_seed(seed)
    dense = [models.Dense(64, 96, bias=False, activation_function=torch.nn.Identity()),
             models.Dense(96, 48, bias=True, activation_function=torch.nn.Tanh())]
    return _save_sentence_transformer(base, root / "embedding_gemma", [models.Pooling(64, "mean"), *dense,
                                                                       models.Normalize()], GEMMA_PROMPTS)


def write_qwen3_reranker(directory: Path, seed: int = 2) -> Any:
    """A Qwen3ForCausalLM over the yes/no tokenizer (left padding, as the model card pads): its transformers model."""
    _, model = write_tiny_checkpoint(directory, "qwen3", seed=seed, vocab_size=260, head_dim=16,
                                     tie_word_embeddings=True)
    write_tokenizer(directory, padding_side="left")
    return model


def write_cross_encoder(directory: Path, seed: int = 3) -> Any:
    """A Qwen3ForSequenceClassification with one label (pad id 0, never in the test's text): its transformers model."""
    from transformers import AutoModelForSequenceClassification

    _, model = write_tiny_checkpoint(directory, "qwen3", seed, AutoModelForSequenceClassification, vocab_size=260,
                                     head_dim=16, num_labels=1, pad_token_id=0)
    write_tokenizer(directory)
    return model


def model_card_scores(directory: Path, hf_model: Any, query: str, documents: list[str]) -> Any:
    """Qwen3-Reranker's model card computation in transformers (its format_instruction,
    process_inputs and compute_logits, left padding): P("yes") against "no" per document."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, padding_side="left")
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    task = "Given a web search query, retrieve relevant passages that answer the query"
    pairs = [f"<Instruct>: {task}\n<Query>: {query}\n<Document>: {doc}" for doc in documents]
    inputs = tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False, max_length=8192)
    head, tail = tokenizer.encode(prefix, add_special_tokens=False), tokenizer.encode(suffix, add_special_tokens=False)
    inputs["input_ids"] = [head + ids + tail for ids in inputs["input_ids"]]
    inputs = tokenizer.pad(inputs, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = hf_model(**inputs).logits[:, -1, :]
        return torch.log_softmax(torch.stack([logits[:, no], logits[:, yes]], dim=1), dim=1)[:, 1].exp().numpy()
