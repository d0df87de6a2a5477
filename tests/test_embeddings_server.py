"""``POST /v1/embeddings``, ``/v1/rerank`` and Ollama's ``/api/embed`` / ``/api/embeddings``
against the real clients (the official ``openai`` client's ``embeddings.create``, ``ollama``'s
``embed``, langchain's ``OpenAIEmbeddings``), their vectors checked against
sentence-transformers' ``encode`` on the same dir and the rerank scores against the
Qwen3-Reranker model card's computation in transformers; bad input gets an OpenAI-shaped 400."""

from __future__ import annotations

import json
import threading

import mlx.core as mx
import numpy as np
import pytest

import embedding_models as em
from conftest import edit_config
from server_support import MODEL_NAME, error_of, http, served

from mlxformer import load

BOUND = 1e-4
QUERY = "What is the capital of China?"
DOCUMENTS = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies towards each other.",
             "no, yes", "Beijing"]
CONTEXT = 128  # the served model's context: a longer input is refused (or, by Ollama, cut)


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    directory = em.write_qwen3_embedding(tmp_path_factory.mktemp("served_embedding"))
    edit_config(directory, max_position_embeddings=CONTEXT)
    reference = SentenceTransformer(str(directory), device="cpu")
    model, tokenizer = load(directory, dtype=mx.float32)
    with served(model, tokenizer, max_batch=2) as server:
        server.reference = reference
        yield server


@pytest.fixture(scope="module")
def reranker_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("served_reranker")
    hf = em.write_qwen3_reranker(directory)
    expected = em.model_card_scores(directory, hf, QUERY, DOCUMENTS)
    model, tokenizer = load(directory, dtype=mx.float32)
    with served(model, tokenizer, max_batch=2) as server:
        server.expected = expected
        yield server


def test_openai_client_embeddings(embedding_server):
    from openai import OpenAI

    client = OpenAI(base_url=embedding_server.url + "/v1", api_key="unused", max_retries=0)
    expected = embedding_server.reference.encode(em.TEXTS, normalize_embeddings=True)
    reply = client.embeddings.create(model=MODEL_NAME, input=em.TEXTS)  # the client asks for base64
    assert [d.index for d in reply.data] == list(range(len(em.TEXTS)))
    assert np.abs(np.array([d.embedding for d in reply.data]) - expected).max() < BOUND
    assert reply.usage.prompt_tokens == sum(len(embedding_server.tokenizer.encode(t)) for t in em.TEXTS)
    floats = client.embeddings.create(model=MODEL_NAME, input=em.TEXTS[0], encoding_format="float")
    assert np.abs(np.array(floats.data[0].embedding) - expected[0]).max() < BOUND
    # token ids, as given (the tokenizer's own, end-of-text included)
    ids = [embedding_server.reference.tokenizer(t)["input_ids"] for t in em.TEXTS[:2]]
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids)
    assert np.abs(np.array([d.embedding for d in by_ids.data]) - expected[:2]).max() < BOUND
    # Matryoshka: sentence-transformers' truncate_dim, normalized
    short = client.embeddings.create(model=MODEL_NAME, input=em.TEXTS, dimensions=16)
    cut = expected[:, :16] / np.linalg.norm(expected[:, :16], axis=1, keepdims=True)
    assert np.abs(np.array([d.embedding for d in short.data]) - cut).max() < BOUND
    # the model's query instruction (a sentence-transformers prompt), by name
    query = client.embeddings.create(model=MODEL_NAME, input=em.TEXTS[:2], extra_body={"prompt_name": "query"})
    expected_query = embedding_server.reference.encode(em.TEXTS[:2], prompt_name="query", normalize_embeddings=True)
    assert np.abs(np.array([d.embedding for d in query.data]) - expected_query).max() < BOUND


def test_served_embedding_gemma_with_dense_modules(tmp_path):
    """EmbeddingGemma's two Dense projections, served: the engine's thread runs them (their
    weights, read lazily on the loading thread, failed there: a 500 on every request)."""
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    directory = em.write_embedding_gemma(tmp_path)
    expected = SentenceTransformer(str(directory), device="cpu").encode(em.TEXTS, normalize_embeddings=True)
    model, tokenizer = load(directory, dtype=mx.float32)
    with served(model, tokenizer, max_batch=2) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.embeddings.create(model=MODEL_NAME, input=em.TEXTS)
    assert np.abs(np.array([d.embedding for d in reply.data]) - expected).max() < BOUND


def test_ollama_client_embed(embedding_server):
    import ollama

    client = ollama.Client(host=embedding_server.url)
    expected = embedding_server.reference.encode(em.TEXTS, normalize_embeddings=True)
    reply = client.embed(model=MODEL_NAME, input=em.TEXTS)
    assert np.abs(np.array(reply.embeddings) - expected).max() < BOUND
    assert reply.prompt_eval_count == sum(len(embedding_server.tokenizer.encode(t)) for t in em.TEXTS)
    old = client.embeddings(model=MODEL_NAME, prompt=em.TEXTS[2])
    assert np.abs(np.array(old.embedding) - expected[2]).max() < BOUND
    # Ollama cuts an input longer than the context (truncate defaults to true) and refuses it when told not to
    long_text = "word " * CONTEXT
    assert len(client.embed(model=MODEL_NAME, input=long_text).embeddings[0]) == 64
    with pytest.raises(ollama.ResponseError, match="maximum context length"):
        client.embed(model=MODEL_NAME, input=long_text, truncate=False)


def test_langchain_openai_embeddings(embedding_server):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=MODEL_NAME, base_url=embedding_server.url + "/v1", api_key="unused",
                                  check_embedding_ctx_length=False, max_retries=0)
    expected = embedding_server.reference.encode(em.TEXTS, normalize_embeddings=True)
    assert np.abs(np.array(embeddings.embed_documents(em.TEXTS)) - expected).max() < BOUND
    assert np.abs(np.array(embeddings.embed_query(em.TEXTS[1])) - expected[1]).max() < BOUND


def test_concurrent_embedding_requests_each_get_their_own(embedding_server):
    """Requests at once run as separate engine jobs; each gets its own inputs' vectors."""
    expected = embedding_server.reference.encode(em.TEXTS, normalize_embeddings=True)
    results: dict[int, np.ndarray] = {}

    def one(i: int) -> None:
        status, _, body = http(embedding_server.url, "POST", "/v1/embeddings", {"input": em.TEXTS[i]})
        assert status == 200
        results[i] = np.array(json.loads(body)["data"][0]["embedding"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(em.TEXTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert np.abs(np.stack([results[i] for i in range(len(em.TEXTS))]) - expected).max() < BOUND


@pytest.mark.parametrize("body,param,message", [
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["ok", ""]}, "input", "empty string"),
    ({"input": [[1, 2], []]}, "input", "empty list of tokens"),
    ({"input": [5, 99999]}, "input", "token ids must be in"),
    ({"input": "x", "dimensions": 0}, "dimensions", None),
    ({"input": "x", "dimensions": 65}, "dimensions", "at most 64"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", None),
    ({"input": "x", "prompt_name": "nope"}, "prompt_name", "unknown prompt name"),
    ({"input": "word " * CONTEXT}, "input", "maximum context length"),
    ({"input": 3}, "input", None),
])
def test_bad_embedding_requests_get_openai_shaped_400(embedding_server, body, param, message):
    status, _, raw = http(embedding_server.url, "POST", "/v1/embeddings", body)
    assert status == 400
    error = error_of(raw)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message is None or message in error["message"]


def test_rerank_sorted_by_relevance(reranker_server):
    expected = reranker_server.expected
    status, _, raw = http(reranker_server.url, "POST", "/v1/rerank",
                          {"model": MODEL_NAME, "query": QUERY, "documents": DOCUMENTS, "top_n": 3})
    assert status == 200, raw
    reply = json.loads(raw)
    order = list(np.argsort(-expected)[:3])
    assert [r["index"] for r in reply["results"]] == order
    for result in reply["results"]:
        assert abs(result["relevance_score"] - expected[result["index"]]) < BOUND
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    # Jina/Cohere's document objects, without the documents echoed
    status, _, raw = http(reranker_server.url, "POST", "/v1/rerank",
                          {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "return_documents": False})
    results = json.loads(raw)["results"]
    assert len(results) == len(DOCUMENTS) and all("document" not in r for r in results)
    assert [r["index"] for r in results] == list(np.argsort(-expected))


def test_bad_rerank_requests(reranker_server, embedding_server):
    for body, param in (({"query": QUERY, "documents": []}, "documents"), ({"query": QUERY}, "documents"),
                        ({"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n")):
        status, _, raw = http(reranker_server.url, "POST", "/v1/rerank", body)
        assert status == 400 and error_of(raw)["param"] == param
    # an embedding model has no head to score with
    status, _, raw = http(embedding_server.url, "POST", "/v1/rerank", {"query": QUERY, "documents": ["a"]})
    assert status == 400 and "no output head" in error_of(raw)["message"]


def test_embeddings_beside_generation(tmp_path):
    """A causal LM serves completions and embeddings at once: the embedding jobs run between the
    decode steps, the completion's greedy text is the one it has alone, and the vectors are
    transformers' last hidden states (last token, normalized)."""
    import torch

    from conftest import write_byte_tokenizer, write_tiny_checkpoint
    from mlxformer.engine import EngineNotRunning

    _, hf = write_tiny_checkpoint(tmp_path, "llama", head_dim=16)
    write_byte_tokenizer(tmp_path)
    model, tokenizer = load(tmp_path, dtype=mx.float32)
    completion = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}
    with served(model, tokenizer, max_batch=2) as server:
        status, _, alone = http(server.url, "POST", "/v1/completions", completion)
        assert status == 200
        replies: list[bytes] = []
        thread = threading.Thread(target=lambda: replies.append(http(server.url, "POST", "/v1/completions", completion)[2]))
        thread.start()
        vectors = []
        for text in em.TEXTS:
            status, _, body = http(server.url, "POST", "/v1/embeddings", {"input": text})
            assert status == 200
            vectors.append(json.loads(body)["data"][0]["embedding"])
        thread.join(120)
        assert json.loads(replies[0])["choices"][0]["text"] == json.loads(alone)["choices"][0]["text"]
        engine = server.engine
    for text, vector in zip(em.TEXTS, vectors):
        with torch.no_grad():
            last = hf.model(input_ids=torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1].numpy()
        assert np.abs(np.array(vector) - last / np.linalg.norm(last)).max() < BOUND
    with pytest.raises(EngineNotRunning):  # stopped: no job is taken
        engine.run_job(lambda: None)
