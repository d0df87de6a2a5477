"""The last layer past its attention only for the rows whose outputs are read (``keep``, issue 30):
the kept rows' logits against transformers' (MLA, whose queries are cut too, and a Llama), the
last layer's MLP seeing only those rows in ``last_logits`` and in the engine's packed step, and
the packed step's logits bit for bit those of each part alone."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from conftest import max_diff, write_byte_tokenizer, write_tiny_checkpoint
from family_checks import hf_logits, tokens
from mlxformer import load
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine.batch_runner import BatchRunner, TokenRun
from test_mla import write_family

BOUND = 3e-4  # fp32 on both sides

pytestmark = pytest.mark.usefixtures("cpu_module")


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe_lite", "llama"])
def case(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        directory, hf_model = write_tiny_checkpoint(directory, "llama", head_dim=32, hidden_size=64,
                                                    num_attention_heads=2, num_key_value_heads=1)
        write_byte_tokenizer(directory)
    else:
        directory, hf_model = write_family(directory, request.param)
    model, _ = load(directory, dtype=mx.float32)
    return model, hf_model


def test_kept_rows_match_transformers(case):
    """Rows anywhere in a chunk, without a cache and over one (offsets 0 and 9), and the last
    row of a chunk long enough for MLA's expanded form: transformers' logits at those positions."""
    model, hf_model = case
    ids = tokens(40)
    reference = hf_logits(hf_model, ids)
    keep = [0, 5, 8]
    alone = model.logits(model.hidden_states(mx.array(ids[None, :9]), keep=mx.array(keep)))[0]
    assert alone.shape[0] == 3 and max_diff(np.array(alone), reference[keep]) <= BOUND
    cache = make_cache(model, CacheSettings())
    for start, end, keep in ((0, 9, [0, 4, 8]), (9, 40, [0, 12, 30])):
        hidden = model.hidden_states(mx.array(ids[None, start:end]), cache, keep=mx.array(keep))
        got = np.array(model.logits(hidden)[0])
        assert got.shape[0] == len(keep)
        assert max_diff(got, reference[[start + k for k in keep]]) <= BOUND, (start, keep)
    last = model.last_logits(mx.array(ids[None, :20]), make_cache(model, CacheSettings()))
    assert max_diff(np.array(last), reference[19:20]) <= BOUND


def record_last_mlp(model, monkeypatch) -> list[int]:
    """The number of rows each call of the last layer's MLP gets (appended as they come)."""
    layer = model.layers[-1]
    kind = type(layer[layer.mlp_name])
    rows: list[int] = []
    original = kind.__call__

    def recording(self, x, *args, **kwargs):
        if self is layer[layer.mlp_name]:
            rows.append(int(np.prod(x.shape[:-1])))
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(kind, "__call__", recording)
    return rows


def test_last_logits_runs_one_row_past_attention(case, monkeypatch):
    model, _ = case
    rows = record_last_mlp(model, monkeypatch)
    cache = make_cache(model, CacheSettings())
    mx.eval(model.last_logits(mx.array(tokens(23)[None]), cache))
    assert rows == [1]
    assert cache[-1].offset == 23  # the last layer's cache still took every row


def test_packed_step_keeps_the_wanted_rows_bit_for_bit(case, monkeypatch):
    """A decoding row and two prompts' chunks (one ending its prompt) in one packed forward: the
    last layer's MLP sees the two wanted rows, and each logit row is what its part gives alone.
    MLA (DeepSeek-V3, GLM-4.7-Flash) too: the 20-token chunk's last layer runs its last query
    alone, in the absorbed form, as its own forward does (all 20 would take the expanded form)."""
    model, _ = case
    runner = BatchRunner(model)
    assert runner.packs
    first, second = (make_cache(model, CacheSettings()) for _ in range(2))
    sequence = SimpleNamespace(cache=make_cache(model, CacheSettings()), speculator=None, last_token=7)
    runner.seat(sequence)  # its row of the pool
    runner.prefill(list(range(1, 21)), sequence.cache, want_logits=False)
    runner.step([sequence])
    mx.eval(runner.step([sequence])[0])
    chunks = [TokenRun(list(range(30, 50)), first, True, 20), TokenRun(list(range(50, 60)), second, False, 20)]
    rows = record_last_mlp(model, monkeypatch)
    logits, chunk_logits = runner.step([sequence], chunks)
    mx.eval(logits, chunk_logits[0])
    assert rows == [2] and chunk_logits[1] is None
    assert second[-1].offset == 10  # the unwanted chunk's keys/values were written

    alone_cache = [make_cache(model, CacheSettings()) for _ in range(2)]
    BatchRunner(model).prefill(list(range(1, 21)), alone_cache[0], want_logits=False)
    for token in (7, 7, 7):  # the two steps before, and the packed one
        decode_alone = model.last_logits(mx.array([[token]]), alone_cache[0])
    chunk_alone = model.last_logits(mx.array([list(range(30, 50))]), alone_cache[1], rope_length=20)
    assert mx.array_equal(logits, decode_alone).item()
    assert mx.array_equal(chunk_logits[0], chunk_alone).item()
