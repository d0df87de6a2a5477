"""Structured output in the continuous-batching engine: constrained and free sequences share a
batch, each constrained output is valid (``jsonschema``, Python's ``re``) and equals what
``stream_generate`` gives alone under the same constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conftest import write_tiny_checkpoint
from mlxformer import load, stream_generate
from mlxformer.constrained import make_constraint
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.generation.stream import SamplingSettings

PADDING = 64  # model vocabulary rows past the tokenizer's last id: must never be sampled
# Finite languages (enums, bounded numbers, no free strings), so that even a random model ends.
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["ok", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
     "sizes": {"type": "array", "items": {"enum": ["S", "M", "L"]}, "maxItems": 3}},
     "required": ["colour", "sizes"], "additionalProperties": False},
]
REGEX = r"(?:cat|dog|bird) #[0-9]{2}"


@pytest.fixture(scope="module")
def tiny_padded(smollm, tmp_path_factory):
    """A tiny random Llama whose vocabulary has ``PADDING`` rows more than SmolLM2's tokenizer."""
    tokenizer = smollm[1]
    directory, _ = write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_structured"), "llama", vocab_size=tokenizer.vocab_size + PADDING,
        tie_word_embeddings=True, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
    )
    tokenizer.save(directory)
    return load(directory)


def _constraints(model, tokenizer):
    vocab = model.args.vocab_size
    return ([make_constraint(tokenizer, vocab, response_format=s) for s in SCHEMAS]
            + [make_constraint(tokenizer, vocab, regex=REGEX)])


def _check(text: str, index: int) -> None:
    if index < len(SCHEMAS):
        jsonschema.validate(json.loads(text), SCHEMAS[index])
    else:
        assert re.fullmatch(REGEX, text), text


def test_batch_keeps_every_constrained_output_valid(tiny_padded):
    model, tokenizer = tiny_padded
    prompts = [tokenizer.encode(p) for p in ("Answer:", "JSON please", "The pet is", "Free text here", "Once")]
    greedy, sampled = SamplingSettings(), SamplingSettings(temp=1.0, seed=7)
    requests = []
    for i, constraint in enumerate(_constraints(model, tokenizer)):  # greedy, constrained
        requests.append(GenerationRequest(prompts[i], max_tokens=200, constraint=constraint))
    for i, constraint in enumerate(_constraints(model, tokenizer)):  # sampled, constrained
        requests.append(GenerationRequest(prompts[i], max_tokens=200, sampling=sampled, constraint=constraint))
    requests += [GenerationRequest(prompts[3], max_tokens=20), GenerationRequest(prompts[4], max_tokens=20, sampling=sampled)]
    with Engine(model, tokenizer, max_batch=4, prefix_cache_bytes=0) as engine:
        handles = [engine.submit(r) for r in requests]
        outputs = [list(h) for h in handles]
    n = len(SCHEMAS) + 1
    for i, events in enumerate(outputs[: 2 * n]):
        text = "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop", (i, text)
        assert all(e.token is None or e.token < tokenizer.vocab_size for e in events)
        _check(text, i % n)
    # Greedy constrained sequences give in the batch exactly what they give alone.
    for i, constraint in enumerate(_constraints(model, tokenizer)):
        alone = list(stream_generate(model, tokenizer, prompts[i], 200, sampling=greedy, constraint=constraint))
        assert "".join(r.text for r in alone) == "".join(e.text for e in outputs[i]), i
    assert [e.finish_reason for e in outputs[-1]][-1] in ("stop", "length")
