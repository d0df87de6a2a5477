"""Prompt cache files checked on load: edited fields and arrays, dtype casts, permissions.

A file whose fingerprint matches but whose arrays or fields were edited must fail on load with
one line naming the file (before: IndexErrors, raw MLX errors mid-generation, or a silently
changed window). References: the caches' own state of an uninterrupted run, ``os.umask``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from mlxformer.cache import CacheSettings, make_cache
from mlxformer.generation.prompt_cache_files import cache_prompt, load_prompt_cache
from mlxformer.errors import MlxformerError
from mlxformer.models.config import ModelArgs
from mlxformer.models.decoder import Model
from mlxformer.text.tokenizer import HFBackend, Tokenizer

TINY = dict(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=256,
    max_position_embeddings=4096, rope_theta=10000.0,
)
TOKENIZER = Tokenizer(HFBackend(HFTokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))),
                      None, [], None)
IDS = np.random.default_rng(0).integers(0, 256, 40).tolist()


def tiny_model(**overrides: object) -> Model:
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict({**TINY, **overrides}))
    mx.eval(model.parameters())
    return model


def edited(path: Path, out: Path, arrays_edit=None, meta_edit=None) -> Path:
    """A copy of the cache file at ``path`` with its arrays / layer-0 meta_state edited."""
    arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    out = out.with_suffix(".safetensors")
    if arrays_edit:
        arrays_edit(arrays)
    if meta_edit:
        metas = json.loads(metadata["meta_states"])
        for meta in metas:
            meta_edit(meta)
        metadata["meta_states"] = json.dumps(metas)
    mx.save_safetensors(str(out), arrays, metadata)
    return out


def refused(path: Path, model: Model, match: str) -> None:
    with pytest.raises(MlxformerError, match=match) as info:
        load_prompt_cache(path, model, TOKENIZER)
    message = str(info.value)
    assert str(path) in message and "\n" not in message


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Cache files of 40 tokens: float, 4-bit, a 24-token rotating ring that has wrapped, and a
    16-token sliding-window model's ring."""
    out = tmp_path_factory.mktemp("pcache")
    made = {
        "float": (tiny_model(), CacheSettings()),
        "q4": (tiny_model(), CacheSettings(kv_bits=4)),
        "ring": (tiny_model(), CacheSettings(max_kv_size=24)),
        "window": (tiny_model(model_type="mistral", sliding_window=16), CacheSettings()),
    }
    for name, (model, settings) in made.items():
        cache = make_cache(model, settings)
        for start in range(0, 30, 10):  # chunks, then single tokens: the ring wraps past its keep
            model(mx.array(IDS[start : start + 10])[None], cache)
        for t in IDS[30:]:
            model(mx.array([t])[None], cache)
        from mlxformer.generation.prompt_cache_files import save_prompt_cache

        save_prompt_cache(out / name, cache, IDS, model, TOKENIZER)
    return {name: out / name for name in made}


def test_untouched_files_load(files):
    for name, path in files.items():
        model = tiny_model(model_type="mistral", sliding_window=16) if name == "window" else tiny_model()
        cache, ids = load_prompt_cache(path, model, TOKENIZER)
        assert ids == IDS and cache[0].offset == 40


def test_shortened_keys_are_refused(files, tmp_path):
    def shorten(arrays):
        arrays["layer.0.0"] = arrays["layer.0.0"][:, :, :30]

    refused(edited(files["float"], tmp_path / "a", shorten), tiny_model(), "layer 0: array 0 has shape")
    refused(edited(files["q4"], tmp_path / "b", shorten), tiny_model(), "layer 0: array 0 has shape")


def test_wrong_head_dim_is_refused(files, tmp_path):
    def halve_dim(arrays):
        for key in ("layer.1.0", "layer.1.1"):
            arrays[key] = arrays[key].reshape(1, 2, 40, 32)

    refused(edited(files["float"], tmp_path / "a", halve_dim), tiny_model(), r"layer 1: array 0 has shape \(1, 2, 40, 32\)")


def test_edited_ring_index_is_refused(files, tmp_path):
    def move_idx(meta):
        meta["idx"] = str((int(meta["idx"]) + 3) % 24 or 5)

    refused(edited(files["ring"], tmp_path / "a", meta_edit=move_idx), tiny_model(), "slot positions|idx=")
    refused(edited(files["ring"], tmp_path / "b", meta_edit=lambda m: m.update(idx="99")), tiny_model(), "idx=99")


def test_changed_window_is_refused(files, tmp_path):
    """The fingerprint still matches; the ring's size no longer fits what it holds or the model."""
    window_model = tiny_model(model_type="mistral", sliding_window=16)
    refused(edited(files["window"], tmp_path / "a", meta_edit=lambda m: m.update(max_size="32")), window_model,
            "sliding window")
    refused(edited(files["window"], tmp_path / "b", meta_edit=lambda m: m.update(max_size="8")), window_model,
            "more than max_size")
    refused(edited(files["ring"], tmp_path / "c", meta_edit=lambda m: m.update(max_size="48")), tiny_model(),
            "does not fit")


def test_other_edited_fields_are_refused(files, tmp_path):
    model = tiny_model()
    refused(edited(files["q4"], tmp_path / "a", meta_edit=lambda m: m.update(bits="3")), model, "bits=3")
    refused(edited(files["q4"], tmp_path / "b", meta_edit=lambda m: m.update(group_size="x")), model, "group_size")
    refused(edited(files["ring"], tmp_path / "c", meta_edit=lambda m: m.update(offset="41")), model, "offset=41")
    refused(edited(files["float"], tmp_path / "d", lambda a: a.pop("layer.1.1")), model, "layer 1: 1 arrays")
    refused(edited(files["float"], tmp_path / "e", lambda a: a.update(extra=mx.zeros(2))), model, "unexpected array")
    refused(edited(files["window"], tmp_path / "f"), model, "different model config")


def test_fingerprint_ignores_the_compute_dtype(tmp_path):
    """A float32 checkpoint run with --dtype float16 (or bfloat16) uses the cache it made."""
    path = tmp_path / "f32"
    cache_prompt(path, tiny_model(), TOKENIZER, IDS[:10])
    for dtype in (mx.float16, mx.bfloat16):
        model = tiny_model()
        model.set_dtype(dtype)
        assert load_prompt_cache(path, model, TOKENIZER)[1] == IDS[:10]
    other = Model(ModelArgs.from_dict(TINY))  # the same shapes, other weights
    mx.eval(other.parameters())
    with pytest.raises(MlxformerError, match="different model weights"):
        load_prompt_cache(path, other, TOKENIZER)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_honour_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        cache_prompt(tmp_path / "p", tiny_model(), TOKENIZER, IDS[:5])
    finally:
        os.umask(old)
    assert (tmp_path / "p").stat().st_mode & 0o777 == mode
    assert [p.name for p in tmp_path.iterdir()] == ["p"]
