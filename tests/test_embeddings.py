"""Embeddings and rerank scores from the library (``mlxformer.embeddings``) against the
references: sentence-transformers' ``encode`` on the same dirs (Qwen3-Embedding-shaped: last
token, query instruction; EmbeddingGemma-shaped: bidirectional attention with a sliding window,
mean pooling, two Dense projections), transformers' hidden states for ``--pooling``, the
Qwen3-Reranker model card's computation in transformers, transformers' sequence classifier,
and a GGUF written by llama.cpp's ``convert_hf_to_gguf.py`` (beside llama.cpp's own embeddings)."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
import torch

import embedding_models as em
from test_gguf_families import CONVERTER

from mlxformer import embed, load, rerank
from mlxformer.embeddings import encode
from mlxformer.embeddings.encode import batches, embed_tokens
from mlxformer.embeddings.head import with_pooling
from mlxformer.errors import MlxformerError

BOUND = 1e-4
QUERY = "What is the capital of China?"
DOCUMENTS = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies towards each other.",
             "no, yes", "Beijing"]


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory):
    return em.write_qwen3_embedding(tmp_path_factory.mktemp("qwen3_embedding"))


@pytest.fixture(scope="module")
def embedding_gemma(tmp_path_factory):
    return em.write_embedding_gemma(tmp_path_factory.mktemp("embedding_gemma"))


@pytest.mark.parametrize("which,prompt", [("qwen3_embedding", "query"), ("embedding_gemma", "document")])
def test_embeddings_match_sentence_transformers(request, which, prompt):
    from sentence_transformers import SentenceTransformer

    directory = request.getfixturevalue(which)
    reference = SentenceTransformer(str(directory), device="cpu")
    model, tokenizer = load(directory, dtype=mx.float32)
    for name in (None, prompt):
        expected = reference.encode(em.TEXTS, prompt_name=name, normalize_embeddings=True, batch_size=3)
        ours = embed(model, tokenizer, em.TEXTS, prompt_name=name)
        assert ours.shape == expected.shape
        assert np.abs(ours - expected).max() < BOUND, (which, name)
    # Matryoshka: the first features, normalized again (sentence-transformers' truncate_dim)
    expected = SentenceTransformer(str(directory), device="cpu", truncate_dim=16).encode(em.TEXTS, normalize_embeddings=True)
    assert np.abs(embed(model, tokenizer, em.TEXTS, dimensions=16) - expected).max() < BOUND


def test_embedding_gemma_attends_both_ways(embedding_gemma):
    """The bidirectional mask matters: a causal forward of the same weights gives other vectors."""
    import dataclasses

    from mlxformer.models.decoder import Model

    model, tokenizer = load(embedding_gemma, dtype=mx.float32)
    assert model.args.bidirectional and model.embedding_head.pooling == "mean" and len(model.embedding_head.dense) == 2
    causal = Model(dataclasses.replace(model.args, bidirectional=False))
    causal.update(model.parameters())
    causal.embedding_head = model.embedding_head
    assert np.abs(embed(causal, tokenizer, em.TEXTS) - embed(model, tokenizer, em.TEXTS)).max() > 1e-2


@pytest.mark.parametrize("chunk", [encode.CHUNK_TOKENS, 5])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooling_setting_on_a_causal_lm(tmp_path_factory, monkeypatch, pooling, chunk):
    """``--pooling`` on a plain causal LM (no sentence-transformers files): transformers' final
    hidden states of each text alone, pooled and normalized; the same with the texts run in
    chunks of 5 tokens over a cache (as an input past ``CHUNK_TOKENS`` runs)."""
    monkeypatch.setattr(encode, "CHUNK_TOKENS", chunk)
    directory, hf = _causal_lm(tmp_path_factory)
    model, tokenizer = load(directory, dtype=mx.float32)
    assert model.embedding_head.pooling == "last" and model.embedding_head.normalize
    head = with_pooling(model.embedding_head, pooling)
    ours = embed(model, tokenizer, em.TEXTS, head=head)
    for text, vector in zip(em.TEXTS, ours):
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.no_grad():
            hidden = hf.model(input_ids=ids).last_hidden_state[0].numpy()
        pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
        assert np.abs(vector - pooled / np.linalg.norm(pooled)).max() < BOUND


def test_a_long_input_costs_memory_linear_in_its_length(tmp_path_factory, monkeypatch):
    """Past ``CHUNK_TOKENS`` an input runs in chunks over a cache: doubling it about doubles the
    peak memory (one forward: attention scores grow with its square, measured 3.1x)."""
    monkeypatch.setattr(encode, "CHUNK_TOKENS", 64)
    directory, _ = _causal_lm(tmp_path_factory)
    model, _ = load(directory, dtype=mx.float32)
    peaks = []
    for length in (512, 1024):
        mx.reset_peak_memory()
        embed_tokens(model, [[5] * length])
        peaks.append(mx.get_peak_memory())
    assert peaks[1] / peaks[0] < 2.0, peaks


_CAUSAL: dict = {}


def _causal_lm(tmp_path_factory):
    from conftest import write_byte_tokenizer, write_tiny_checkpoint

    if not _CAUSAL:
        directory = tmp_path_factory.mktemp("causal_lm")
        _, hf = write_tiny_checkpoint(directory, "llama", head_dim=16)
        write_byte_tokenizer(directory)
        _CAUSAL["value"] = (directory, hf)
    return _CAUSAL["value"]


def test_batches_stay_within_the_token_budget():
    lengths = [5, 1, 9, 3, 3, 20]
    groups = batches(lengths, budget=10)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for group in groups:
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 10
    assert [5] in groups  # longer than the budget: alone


def test_batching_does_not_change_the_vectors(qwen3_embedding):
    model, tokenizer = load(qwen3_embedding, dtype=mx.float32)
    ids = [tokenizer.encode(t) for t in em.TEXTS]
    together = embed_tokens(model, ids, budget=4096)
    alone = embed_tokens(model, ids, budget=1)
    assert np.abs(together - alone).max() < 1e-5


def test_rerank_matches_the_qwen3_reranker_model_card(tmp_path):
    hf = em.write_qwen3_reranker(tmp_path)
    expected = em.model_card_scores(tmp_path, hf, QUERY, DOCUMENTS)
    model, tokenizer = load(tmp_path, dtype=mx.float32)
    ours = np.array(rerank(model, tokenizer, QUERY, DOCUMENTS))
    assert np.abs(ours - expected).max() < BOUND
    assert len(set(np.round(ours, 4))) == len(DOCUMENTS)  # distinct scores: the test can see a swap


def test_cross_encoder_scores_match_transformers(tmp_path):
    from mlxformer.embeddings.rerank import rerank_inputs

    hf = em.write_cross_encoder(tmp_path)
    model, tokenizer = load(tmp_path, dtype=mx.float32)
    assert model.args.head == "score" and model.args.num_labels == 1
    ours = np.array(rerank(model, tokenizer, QUERY, DOCUMENTS))
    with torch.no_grad():  # one pair at a time: transformers pools the last non-pad token
        expected = np.array([torch.sigmoid(hf(input_ids=torch.tensor([ids])).logits[0, 0]).item()
                             for ids in rerank_inputs(tokenizer, QUERY, DOCUMENTS)])
    assert np.abs(ours - expected).max() < BOUND


def test_bad_input_is_one_clear_error(qwen3_embedding):
    model, tokenizer = load(qwen3_embedding, dtype=mx.float32)
    with pytest.raises(MlxformerError, match="unknown prompt name 'nope'"):
        embed(model, tokenizer, "x", prompt_name="nope")
    with pytest.raises(MlxformerError, match="dimensions must be between 1 and 64"):
        embed(model, tokenizer, "x", dimensions=65)
    with pytest.raises(MlxformerError, match="unknown pooling"):
        with_pooling(model.embedding_head, "max")
    with pytest.raises(MlxformerError, match="no language-model head"):
        model.logits(mx.zeros((1, 64)))
    with pytest.raises(MlxformerError, match="no output head"):
        rerank(model, tokenizer, "q", ["d"])


def test_gguf_embedding_model_from_llama_cpp_converter(tmp_path, hf_smollm_tokenizer):
    """llama.cpp's converter on a Qwen3-Embedding-shaped dir (SmolLM2's tokenizer: one it knows)
    writes ``qwen3.pooling_type`` 3 (last); mlxformer's vectors from the GGUF match
    sentence-transformers' on the dir and llama.cpp's (llama_cpp) on the file."""
    from sentence_transformers import SentenceTransformer, models

    if not CONVERTER.is_file():
        pytest.fail(f"{CONVERTER} is missing: run scripts/install_test_deps.sh")
    base = tmp_path / "base"
    base.mkdir()
    em._base_model(base, "qwen3", 4, vocab_size=len(hf_smollm_tokenizer))
    hf_smollm_tokenizer.save_pretrained(base)
    # no chat template: sentence-transformers 6 would render each text as a chat message
    (base / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    directory = em._save_sentence_transformer(base, tmp_path / "st", [models.Pooling(64, "lasttoken"), models.Normalize()],
                                              {"query": em.QWEN3_QUERY_PROMPT})
    out = tmp_path / "embedding.gguf"
    done = subprocess.run([sys.executable, str(CONVERTER), str(directory), "--outtype", "f32", "--outfile", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    import gguf

    reader = gguf.GGUFReader(str(out))
    assert int(reader.fields["qwen3.pooling_type"].parts[-1][0]) == 3
    model, tokenizer = load(out, dtype=mx.float32)
    assert model.embedding_head.pooling == "last"
    expected = SentenceTransformer(str(directory), device="cpu").encode(em.TEXTS, normalize_embeddings=True)
    ours = embed(model, tokenizer, em.TEXTS)
    assert np.abs(ours - expected).max() < BOUND
    # llama.cpp's own embeddings of the same file (its pooling read from the file)
    from llama_cpp import Llama

    llama = Llama(model_path=str(out), embedding=True, n_ctx=256, n_batch=256, n_threads=1, verbose=False,
                  type_k=0, type_v=0)  # float32 keys and values (its default: float16)
    assert np.abs(np.array(llama.embed(em.TEXTS, normalize=True)) - ours).max() < BOUND


def test_embed_command(qwen3_embedding, capsys):
    """``mlxformer embed``: one JSON vector a line (sentence-transformers' query-prompted,
    truncated to 8 features and normalized); a bad prompt name is one error line."""
    from sentence_transformers import SentenceTransformer

    from mlxformer.cli import main

    assert main(["embed", "-m", str(qwen3_embedding), "--dtype", "float32", "--prompt-name", "query",
                 "--dimensions", "8", *em.TEXTS[:2]]) == 0
    vectors = np.array([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    reference = SentenceTransformer(str(qwen3_embedding), device="cpu", truncate_dim=8)
    expected = reference.encode(em.TEXTS[:2], prompt_name="query", normalize_embeddings=True)
    assert np.abs(vectors - expected).max() < BOUND
    capsys.readouterr()
    assert main(["embed", "-m", str(qwen3_embedding), "--pooling", "mean", "--prompt-name", "nope", "x"]) == 1
    assert capsys.readouterr().err.strip() == "mlxformer: error: unknown prompt name 'nope' (this model's: document, query)"


def test_hub_download_fetches_the_sentence_transformers_modules():
    """The hub client's own filter over EmbeddingGemma's file list: the modules' configs and the
    Dense projections' safetensors too, never their pickles."""
    from huggingface_hub.utils import filter_repo_objects

    from mlxformer.formats.hub import HUB_ALLOW_PATTERNS

    files = ["config.json", "model.safetensors", "modules.json", "config_sentence_transformers.json",
             "sentence_bert_config.json", "1_Pooling/config.json", "2_Dense/config.json", "2_Dense/model.safetensors",
             "3_Dense/config.json", "3_Dense/model.safetensors", "3_Dense/pytorch_model.bin", "tokenizer.json",
             "tokenizer_config.json", "README.md"]
    fetched = set(filter_repo_objects(files, allow_patterns=HUB_ALLOW_PATTERNS))
    assert fetched == set(files) - {"3_Dense/pytorch_model.bin", "README.md"}
