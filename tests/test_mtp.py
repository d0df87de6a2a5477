"""Native MTP speculation on tiny random Qwen3.5 (``qwen3_5_text``) and Qwen3-Next checkpoints
with ``mtp.*`` weights added in the hub's layout (``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*``, ``mtp.norm``; config ``mtp_num_hidden_layers``).

The MTP layer's weights are those of a one-layer transformers model of the same family, so the
reference for the head is transformers' own decoder layer, final norm and ``lm_head``, fed
``fc([norm_e(emb(x_{p+1})), norm_h(h_p)])`` with ``h`` transformers' final hidden states.
Greedy output with ``--mtp`` equals plain decoding (generate, engine, server); a head built to
predict the target exactly (the target's next token depends on its input token only, the head's
``fc`` passes the embedding half through) gets every proposal accepted, so the draft path is
the one used.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten, tree_unflatten
from safetensors.numpy import load_file, save_file

from conftest import max_diff, perturb_, write_byte_tokenizer, write_tiny_checkpoint
from mlxformer import load, stream_generate
from mlxformer.cache import CacheSettings, make_cache
from mlxformer.engine import Engine, GenerationRequest
from mlxformer.errors import MlxformerError
from mlxformer.speculative.mtp import load_mtp
from mlxformer.sampling.samplers import make_distribution
from mlxformer.speculative.speculator import SpeculativeSettings, rewind
from mlxformer.generation.steps import prefill

BOUND = 3e-3  # fp32 both sides, as tests/test_hybrid.py
HYBRID = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=4)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
CASES = {"qwen3_5_text": {}, "qwen3_next": EXPERTS}
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 256, size=11)]


pytestmark = pytest.mark.usefixtures("cpu_module")


def add_mtp_weights(directory, model_type: str, hf_model, extra: dict) -> dict[str, torch.Tensor]:
    """Write random ``mtp.*`` tensors into ``directory``'s checkpoint: the layer from a one-layer
    transformers model of ``model_type``; returns the reference pieces."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TINY_SHAPE

    config = AutoConfig.for_model(model_type, **{**TINY_SHAPE, **HYBRID, **extra, "num_hidden_layers": 1,
                                                 "layer_types": ["full_attention"]})
    config._attn_implementation = "eager"
    torch.manual_seed(7)
    source = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_(source, seed=7)
    source.lm_head.weight.data.copy_(hf_model.lm_head.weight.data)  # the main model's output projection
    source.eval()
    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(8)
    norm_e, norm_h = (1.0 + 0.3 * torch.randn(hidden, generator=generator) for _ in range(2))
    fc = 1.5 * torch.randn(hidden, 2 * hidden, generator=generator) / (2 * hidden) ** 0.5
    tensors = load_file(directory / "model.safetensors")
    saved = directory.parent / f"{directory.name}-mtp-source"
    source.save_pretrained(saved)  # the hub's layout (per-expert matrices)
    for name, value in load_file(saved / "model.safetensors").items():
        if name.startswith("model.layers.0."):
            tensors["mtp.layers.0." + name[len("model.layers.0."):]] = value
    tensors.update({"mtp.fc.weight": fc.numpy(), "mtp.pre_fc_norm_embedding.weight": norm_e.numpy(),
                    "mtp.pre_fc_norm_hidden.weight": norm_h.numpy(),
                    "mtp.norm.weight": source.model.norm.weight.detach().numpy()})
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "mtp_num_hidden_layers": 1}))
    return {"source": source, "fc": fc, "norm_e": norm_e, "norm_h": norm_h}


def make_case(tmp_path_factory, name: str):
    directory, hf_model = write_tiny_checkpoint(tmp_path_factory.mktemp(name), name, **HYBRID, **CASES[name])
    write_byte_tokenizer(directory)
    pieces = add_mtp_weights(directory, name, hf_model, CASES[name])
    model, tokenizer = load(directory, dtype=mx.float32, threads=1)
    tokenizer.eos_token_ids = []
    return directory, model, tokenizer, hf_model, pieces


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return make_case(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_case(tmp_path_factory, "qwen3_5_text")


def mtp_reference(hf_model, pieces, ids: list[int]) -> np.ndarray:
    """transformers' MTP logits ``(len - 1, vocab)``: row ``p`` predicts ``ids[p + 2]``."""
    norm_class = type(hf_model.model.norm)
    hidden = hf_model.config.hidden_size

    def norm(x, weight):
        module = norm_class(hidden, eps=hf_model.config.rms_norm_eps)
        module.weight.data.copy_(weight)
        return module(x)

    with torch.no_grad():
        t = torch.tensor([ids])
        h = hf_model.model(t).last_hidden_state[:, :-1]  # final-norm hidden states of positions p
        emb = hf_model.model.embed_tokens(t[:, 1:])  # tokens p + 1
        x = torch.cat([norm(emb, pieces["norm_e"]), norm(h, pieces["norm_h"])], dim=-1) @ pieces["fc"].T
        return pieces["source"](inputs_embeds=x).logits[0].numpy()


def test_head_matches_transformers(case):
    directory, model, _, hf_model, pieces = case
    drafter = load_mtp(directory, model)
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 256, size=40)]
    hidden = model.hidden_states(mx.array([ids]))[:, :-1]
    g = drafter.head(drafter.embed(mx.array([ids[1:]])), hidden, make_cache(drafter.head))
    assert max_diff(np.array(model.logits(g)[0]), mtp_reference(hf_model, pieces, ids)) <= BOUND


def test_proposer_feeds_the_pairs_the_target_computed(case):
    """First round after the prompt, then rounds after partial rejections (the chained drafts
    and the rejected rows trimmed), then a next turn that changes the last two tokens (a stale
    MTP entry trimmed): each round's first draft is drawn from transformers' MTP distribution
    for the history (drafts sampled at temperature 1, so their probabilities are returned)."""
    from conftest import log_softmax

    directory, model, _, hf_model, pieces = case
    drafter = load_mtp(directory, model)
    cache = make_cache(model, CacheSettings(rewind=4))  # the hybrid state caches keep 4 tokens' states
    proposer = drafter.new_proposer(None)
    keys = iter(range(1000))
    proposer.bind(make_distribution(1.0), lambda: mx.random.key(next(keys)))
    proposer.follow(cache)

    def check(history: list[int], k: int) -> list[int]:
        drafts, probs = proposer.propose(history, k)
        drafts = drafts.tolist()  # left on the device until the round's read
        reference = log_softmax(mtp_reference(hf_model, pieces, history)[-1])
        assert np.abs(np.log(np.array(probs[0])) - reference).max() <= BOUND
        return drafts

    history = PROMPT + [int(mx.argmax(prefill(model, mx.array(PROMPT), cache, step_size=4), axis=-1).item())]
    for _ in range(3):
        drafts = check(history, 3)
        targets = mx.argmax(model(mx.array([[history[-1], *drafts]]), cache)[0], axis=-1).tolist()
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, targets)) if d != t), len(drafts))
        accepted = min(accepted, 1)  # take back at least one accepted draft's rows too
        rewind(cache, len(drafts) - accepted)
        history = history + drafts[:accepted] + [targets[accepted]]
    # a next turn that changes the last two tokens (as a chat's re-rendered reply may): the
    # target's cache is cut back one token, and the MTP entry paired with the first changed
    # token is stale and goes too; the rest is prefilled
    turn = history[:-2] + [50, 51, 52, 53]
    rewind(cache, 1)
    prefill(model, mx.array(turn[len(history) - 2:-1]), cache)
    check(turn, 2)


def greedy(model, tokenizer, speculative=None, n=24):
    return [(r.token, r.proposed_tokens, r.accepted_tokens)
            for r in stream_generate(model, tokenizer, PROMPT, max_tokens=n, speculative=speculative)]


def test_greedy_with_mtp_equals_plain(case):
    directory, model, tokenizer, _, _ = case
    plain = [t for t, _, _ in greedy(model, tokenizer)]
    settings = SpeculativeSettings(mtp=load_mtp(directory, model), num_draft_tokens=3)
    fast = greedy(model, tokenizer, settings)
    assert [t for t, _, _ in fast] == plain
    assert fast[-1][1] > 0  # proposals were made (random weights: few accepted)


def exact_head(directory, model):
    """The model made to predict from its input token alone (every mixer's and MLP's output
    projection zero, so ``h_p = final_norm(emb(x_p))``), and an MTP head that reproduces it one
    token ahead: its layer adds nothing, ``fc`` passes the (unit-norm) embedding half through and
    its final norm is the model's."""
    def zero_outputs(module):
        module.update(tree_unflatten([(k, mx.zeros_like(v)) for k, v in tree_flatten(module.parameters())
                                      if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))]))

    zero_outputs(model)
    drafter = load_mtp(directory, model)
    head = drafter.head
    zero_outputs(head)
    hidden = model.args.hidden_size
    head.fc.weight = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
    head.pre_fc_norm_embedding.weight = mx.zeros((hidden,))  # (1 + w) norms: scale 1
    head.norm.weight = model.model.norm.weight
    mx.eval(model.parameters(), head.parameters())  # not lazily: the engine's thread runs it
    return drafter


def test_an_exact_head_gets_every_proposal_accepted(case):
    directory, _, tokenizer, _, _ = case
    model, _ = load(directory, dtype=mx.float32, threads=1)
    drafter = exact_head(directory, model)
    plain = [t for t, _, _ in greedy(model, tokenizer)]
    fast = greedy(model, tokenizer, SpeculativeSettings(mtp=drafter, num_draft_tokens=3))
    assert [t for t, _, _ in fast] == plain
    proposed, accepted = fast[-1][1:]
    assert proposed >= 15 and accepted == proposed
    # the same through the engine, three requests at once (one of them opting out)
    prompts = [PROMPT, PROMPT[3:], PROMPT[:6]]
    expected = [[r.token for r in stream_generate(model, tokenizer, p, max_tokens=16)] for p in prompts]
    with Engine(model, tokenizer, speculative=SpeculativeSettings(mtp=drafter, num_draft_tokens=2)) as engine:
        handles = [engine.submit(GenerationRequest(p, 16, speculate=i != 2)) for i, p in enumerate(prompts)]
        events = [[e for e in h if e.token is not None] for h in handles]
    assert [[e.token for e in got] for got in events] == expected
    last = [got[-1] for got in events]
    assert last[0].proposed_tokens >= 8 and last[0].accepted_tokens == last[0].proposed_tokens
    assert last[2].proposed_tokens == 0


def test_engine_with_random_mtp_equals_plain(case):
    directory, model, tokenizer, _, _ = case
    prompts = [PROMPT, PROMPT[2:9], [7, 8, 9, 10]]
    expected = [[r.token for r in stream_generate(model, tokenizer, p, max_tokens=12)] for p in prompts]
    with Engine(model, tokenizer, speculative=SpeculativeSettings(mtp=load_mtp(directory, model))) as engine:
        handles = [engine.submit(GenerationRequest(p, 12)) for p in prompts]
        events = [[e for e in h if e.token is not None] for h in handles]
    assert [[e.token for e in got] for got in events] == expected
    assert all(got[-1].proposed_tokens > 0 for got in events)


def test_a_checkpoint_without_mtp_weights_is_a_one_line_error(tmp_path):
    directory, _ = write_tiny_checkpoint(tmp_path, "qwen3_5_text", **HYBRID)
    write_byte_tokenizer(directory)
    model, _ = load(directory, dtype=mx.float32, threads=1)
    with pytest.raises(MlxformerError, match="no multi-token-prediction weights"):
        load_mtp(directory, model)
    result = subprocess.run([sys.executable, "-m", "mlxformer", "generate", "--model", str(directory), "--mtp",
                             "-p", "hi", "--max-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "multi-token-prediction" in result.stderr


def test_engine_turn_from_the_prefix_cache_equals_plain(case):
    """A second turn served from the prefix cache: the MTP layer's cache starts where the
    prefill did (the watch never saw the cached prefix), and the output is still plain decoding's."""
    directory, model, tokenizer, _, _ = case
    with Engine(model, tokenizer, speculative=SpeculativeSettings(mtp=load_mtp(directory, model))) as engine:
        reply = [e.token for e in engine.submit(GenerationRequest(PROMPT, 8)) if e.token is not None]
        turn = PROMPT + reply + [40, 41, 42]
        events = [e for e in engine.submit(GenerationRequest(turn, 10)) if e.token is not None]
    assert events[-1].cached_tokens > len(PROMPT) // 2 and events[-1].proposed_tokens > 0
    assert [e.token for e in events] == [r.token for r in stream_generate(model, tokenizer, turn, max_tokens=10)]


def test_serve_with_mtp_equals_plain_generate(dense):
    """``mlxformer serve --mtp --mtp-tokens 2`` through the openai client: concurrent greedy
    completions are plain ``generate``'s, and the usage reports the proposals."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from server_support import serve_subprocess

    from mlxformer import generate

    directory, model, tokenizer, _, _ = dense
    prompts = [PROMPT, PROMPT[4:]]
    expected = [generate(model, tokenizer, p, 12) for p in prompts]
    command = [sys.executable, "-m", "mlxformer", "serve", "--model", str(directory), "--dtype", "float32",
               "--threads", "1", "--served-model-name", "m", "--mtp", "--mtp-tokens", "2"]
    with serve_subprocess(command) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda ids: client.completions.create(
                model="m", prompt=ids, max_tokens=12, temperature=0), prompts))
    assert [r.choices[0].text for r in replies] == expected
    details = [r.usage.completion_tokens_details for r in replies]
    assert all(d.accepted_prediction_tokens + d.rejected_prediction_tokens > 0 for d in details)


def test_sampled_mtp_is_reproducible_with_its_seed(dense):
    """Sampled drafts (the rejection rule with the MTP head's probabilities): the same seed gives
    the same tokens, another seed other ones."""
    directory, model, tokenizer, _, _ = dense
    settings = SpeculativeSettings(mtp=load_mtp(directory, model), num_draft_tokens=2)

    def run(seed: int):
        return [(r.token, r.proposed_tokens) for r in stream_generate(
            model, tokenizer, PROMPT, max_tokens=16, speculative=settings, temp=1.0, seed=seed)]

    first = run(3)
    assert first == run(3) and first[-1][1] > 0
    assert [t for t, _ in run(4)] != [t for t, _ in first]


def test_prompt_chunks_packed_beside_a_decoding_row_feed_the_watch(dense, monkeypatch):
    """A speculating request's 60-token prompt prefilled in chunks of 16 while another request
    decodes: its chunks ride in the decode steps' packed forwards, and the MTP watch gets every
    row of each (the head drafts from the whole prompt's hidden states, as after a prefill of
    its own); before, a packed step handed it none and its first rows were at position 60."""
    from mlxformer.speculative.mtp import HiddenRows

    directory, model, tokenizer, _, _ = dense
    writes: dict[int, list[tuple[int, int]]] = {}
    write = HiddenRows.write

    def logged(self, start, rows):
        writes.setdefault(id(self), []).append((start, rows.shape[0]))
        return write(self, start, rows)

    monkeypatch.setattr(HiddenRows, "write", logged)
    long = [int(t) for t in np.random.default_rng(5).integers(3, 256, size=60)]
    expected = [r.token for r in stream_generate(model, tokenizer, long, max_tokens=6)]
    with Engine(model, tokenizer, prefill_chunk=16,
                speculative=SpeculativeSettings(mtp=load_mtp(directory, model))) as engine:
        first = iter(engine.submit(GenerationRequest(PROMPT, 40)))
        next(e for e in first if e.token is not None)  # decoding while the long prompt prefills
        got = [e.token for e in engine.submit(GenerationRequest(long, 6)) if e.token is not None]
        list(first)
    assert got == expected
    (rows,) = [w for w in writes.values() if max(start + n for start, n in w) > len(long)]  # the long one's
    assert rows[0][0] == 0, rows
    ends = [start + n for start, n in rows]
    assert all(start <= end for (start, _), end in zip(rows[1:], ends)), rows  # no gap
    assert rows[:4] == [(0, 16), (16, 16), (32, 16), (48, 12)], rows  # the four chunks' rows, each whole
