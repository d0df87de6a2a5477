"""The Python API's bad input (a user-level audit's findings): a clear ``MlxformerError`` before
any forward, never a crash (an id past the embedding table segfaulted ``generate``), a silently
changed request (a ``stop`` string read as its characters, a string as a list of one-character
prompts) or a silently replaced setting (``step_tokens=0``)."""

from __future__ import annotations

import pytest

from mlxformer.errors import MlxformerError, OptionError

PROMPT = "Tell me a story about"


@pytest.fixture(scope="module")
def tiny(tiny_smol):
    from mlxformer import load

    return load(str(tiny_smol[0]))


@pytest.mark.parametrize("ids,message", [
    ([10**7], "token id 10000000 is outside the vocabulary"), ([-1, 5], "token id -1 is outside"),
    ([1.5, 2.0], "token ids must be integers"),
])
def test_prompt_ids_outside_the_vocabulary_are_refused_everywhere(tiny, ids, message):
    from mlxformer.embeddings.encode import embed_tokens
    from mlxformer.engine import Engine, GenerationRequest
    from mlxformer.generation.stream import generate

    model, tokenizer = tiny
    vocab = model.args.vocab_size
    with pytest.raises(OptionError, match=message):
        generate(model, tokenizer, ids, max_tokens=2)
    with pytest.raises(OptionError, match=f"token id {vocab} is outside the vocabulary"):
        generate(model, tokenizer, [vocab], max_tokens=2)  # the first id past the table
    with Engine(model, tokenizer, max_batch=1) as engine, pytest.raises(OptionError, match=message):
        engine.submit(GenerationRequest(ids, 2))
    with pytest.raises(OptionError, match=message):
        embed_tokens(model, [[1, 2], ids])


def test_one_stop_string_is_one_stop_string(tiny):
    """``stop="..."`` stops at that string, as a list of it does (not at its first character)."""
    from mlxformer.embeddings.encode import embed_tokens
    from mlxformer.engine import Engine, GenerationRequest
    from mlxformer.generation.stream import generate

    model, tokenizer = tiny
    whole = generate(model, tokenizer, PROMPT, max_tokens=12)
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    assert min(whole.index(c) for c in stop) < whole.index(stop)  # its characters would cut the text sooner
    expected = generate(model, tokenizer, PROMPT, max_tokens=12, stop=[stop])
    assert generate(model, tokenizer, PROMPT, max_tokens=12, stop=stop) == expected == whole[: whole.index(stop)]
    with Engine(model, tokenizer, max_batch=1) as engine:
        events = list(engine.submit(GenerationRequest(tokenizer.encode(PROMPT), 12, stop=stop)))
    assert "".join(e.text for e in events) == expected


def test_batch_generate_refuses_one_string(tiny):
    from mlxformer.engine import batch_generate

    with pytest.raises(MlxformerError, match="a list of prompts"):
        batch_generate(*tiny, "hello", max_tokens=2)


@pytest.mark.parametrize("name,value", [("step_tokens", 0), ("prefill_chunk", 0), ("max_batch", "4")])
def test_engine_refuses_bad_sizes(tiny, name, value):
    from mlxformer.engine import Engine

    with pytest.raises(OptionError, match=f"{name} must be an integer >= 1 \\(got {value!r}\\)"):
        Engine(*tiny, **{name: value})


def test_wrong_python_types_are_one_clear_error(tiny):
    """A value of the wrong type is an ``OptionError`` naming the option, not Python's own
    ``TypeError`` or ``AttributeError`` from deep inside (each of these raised one)."""
    from mlxformer import embed, load, rerank
    from mlxformer.engine import Engine, GenerationRequest
    from mlxformer.generation.chat import ChatSession
    from mlxformer.generation.stream import generate

    model, tokenizer = tiny
    wrong = [
        (lambda: generate(model, tokenizer, PROMPT, max_tokens=2, sampling={"temp": 0.5}),
         "sampling must be a SamplingSettings \\(got dict\\)"),
        (lambda: generate(model, tokenizer, PROMPT, max_tokens=2, tempp=0.5), "tempp is not an option"),
        (lambda: generate(model, tokenizer, PROMPT, max_tokens=2, stop=5), "stop must be a string or a list of strings"),
        (lambda: generate(model, tokenizer, PROMPT, max_tokens=2, stop=["a", 5]), "stop must be a string or a list"),
        (lambda: generate(model, tokenizer, 5, max_tokens=2), "prompt must be token ids \\(got int\\)"),
        (lambda: generate(model, tokenizer, None, max_tokens=2), "prompt must be token ids"),
        (lambda: embed(model, tokenizer, 5), "texts must be a string or a list of strings"),
        (lambda: embed(model, tokenizer, []), "texts must hold at least one string"),
        (lambda: rerank(model, tokenizer, "q", [1, 2]), "documents must be a string or a list of strings"),
        (lambda: generate(model, tokenizer, PROMPT, max_tokens=2, cache_settings={"kv_bits": 8}),
         "cache_settings must be a CacheSettings \\(got dict\\)"),
        (lambda: generate(model, tokenizer, PROMPT, max_tokens=2, speculative={"prompt_lookup": True}),
         "speculative must be a SpeculativeSettings \\(got dict\\)"),
        (lambda: generate(model, tokenizer, PROMPT, max_tokens=2, cache="x"), "cache must be a list or tuple"),
        (lambda: ChatSession(model, tokenizer, sampling={"temp": 1}), "sampling must be a SamplingSettings"),
        (lambda: load(123), "path_or_repo must be a str or Path \\(got int\\)"),
        (lambda: load("unused", threads="2"), "threads must be an integer >= 1 \\(got '2'\\)"),
        (lambda: load("unused", threads=2.5), "threads must be an integer >= 1 \\(got 2.5\\)"),
    ]
    for call, message in wrong:
        with pytest.raises(OptionError, match=message):
            list(call())
    with Engine(model, tokenizer, max_batch=1) as engine:
        with pytest.raises(OptionError, match="sampling must be a SamplingSettings"):
            engine.submit(GenerationRequest([1, 2], 2, sampling={"temp": 1.0}))
        with pytest.raises(OptionError, match="prompt must be token ids \\(got str\\)"):
            engine.submit(GenerationRequest("hello", 2))
        with pytest.raises(OptionError, match="max_tokens must be an integer >= 1 \\(got '2'\\)"):
            engine.submit(GenerationRequest([1, 2], "2"))
        assert len(list(engine.submit(GenerationRequest([1, 2], 2)))) > 0  # the engine still serves


def test_numpy_token_ids_are_token_ids(tiny):
    """ids as NumPy integers (``tokenizer(...)["input_ids"]`` as arrays) embed as ints do; they
    raised MLX's ValueError."""
    import numpy as np

    from mlxformer.embeddings.encode import embed_tokens

    model, _ = tiny
    ids = [1, 2, 3]
    assert np.array_equal(embed_tokens(model, [np.array(ids)]), embed_tokens(model, [ids]))


def test_an_input_past_the_context_is_refused_before_it_is_embedded(tiny):
    from mlxformer.embeddings.encode import embed_tokens

    model, _ = tiny
    limit = model.args.max_position_embeddings
    with pytest.raises(MlxformerError, match=f"maximum context length is {limit} tokens; an input has {limit + 1}"):
        embed_tokens(model, [[1, 2], [1] * (limit + 1)])
