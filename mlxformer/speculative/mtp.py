"""Native MTP speculation: the checkpoint's own multi-token-prediction head drafts the tokens.

``load_mtp(path, model)`` reads the ``mtp.*`` tensors of the checkpoint ``model`` was loaded
from into an ``MTPHead`` (``models/mtp.py``) and returns an ``MTPDrafter``; passed as
``SpeculativeSettings(mtp=...)`` it gives each speculating sequence an ``MTPProposer``. The
verification, the rollback of the target's caches (hybrid state caches included) and the
acceptance rule are those of every proposer (``speculative.py``).

The head needs the target's final hidden state of every position. The drafter watches the
model's forwards (``Model.watch_hidden``) and hands each one's hidden states to the proposer
that follows those caches (``Proposer.follow``: the sequence's target caches), keyed by
position: a later forward at position ``p`` (after a rewind) replaces the rows from ``p`` on.
At each ``propose`` the proposer feeds its own layer's cache with the pairs
``(x_{p+1}, h_p)`` the target's cache now holds and it has not fed, after trimming back the
previous round's chained drafts and any entry whose next token changed, then chains ``k``
drafts, each step's MTP output as the next step's ``h``. Positions the watch never saw (a
prompt prefix served from the prefix cache) are skipped: the MTP layer's cache then starts
later than the target's, which RoPE does not notice (only relative positions matter).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from mlxformer.cache import Cache, CacheSettings, make_cache
from mlxformer.errors import MlxformerError
from mlxformer.formats.checkpoint import open_part
from mlxformer.formats.expert_layouts import expert_groups
from mlxformer.formats.gguf_names import MTP_ARCHS
from mlxformer.formats.gguf_split import read_any_gguf
from mlxformer.formats.hub import fetch_mtp_sidecar
from mlxformer.formats.weight_map import quantization_of, text_weight_names
from mlxformer.loader import check_weights, quantize_like_checkpoint
from mlxformer.models.decoder import Model
from mlxformer.models.dtype_policy import cast_except_quantized_linears
from mlxformer.models.mtp import MTPHead
from mlxformer.sampling.samplers import Distribution
from mlxformer.speculative.speculator import KeySource, common_prefix_length, draft_token
from mlxformer.generation.steps import default_prefill_step

__all__ = ["HiddenRows", "MTPDrafter", "MTPProposer", "has_mtp_block", "load_mtp"]


def _mtp_names(names: Sequence[str]) -> dict[str, str]:
    """The checkpoint's MTP tensor names -> the head's (``mtp.`` or ``model.mtp.`` stripped)."""
    out = {}
    for name in names:
        for prefix in ("mtp.", "model.mtp."):
            if name.startswith(prefix):
                out[name] = name[len(prefix):]
    return out


def has_mtp_block(path: str | Path | None) -> bool:
    """Whether ``path`` is a GGUF file whose last block is a multi-token-prediction block (its
    ``nextn.eh_proj``) of an architecture whose head is read (``MTP_ARCHS``): llama.cpp's test
    for drafting with a ``-md`` file's MTP head (the converter's ``--mtp`` output, or a whole
    model converted with its MTP layer)."""
    if path is None or not str(path).lower().endswith(".gguf") or not Path(path).is_file():
        return False
    metadata = (gguf := read_any_gguf(Path(path))).metadata
    arch = metadata.get("general.architecture")
    blocks = metadata.get(f"{arch}.block_count")
    return arch in MTP_ARCHS and isinstance(blocks, int) and f"blk.{blocks - 1}.nextn.eh_proj.weight" in gguf.tensors


def load_mtp(path_or_repo: str | Path, model: Model) -> MTPDrafter:
    """The MTP head of the checkpoint at ``path_or_repo``, checked by name, shape and dtype, in
    ``model``'s float dtype; a one-line error when the checkpoint has none. The checkpoint is
    the one ``model`` was loaded from (an HF dir's ``mtp.*``; a GGUF's MTP block, which
    llama.cpp's converter writes by default), or a file holding the head alone (the converter's
    ``--mtp`` output, ``mtp-*.gguf``); for a hub GGUF ``REPO[:QUANT]`` without the head, the
    repo's ``mtp-*.gguf`` beside it (llama.cpp's ``-hf REPO:QUANT --mtp``)."""
    path, config, tensors = open_part(path_or_repo)
    tensors = tensors.renamed(text_weight_names(tensors.entries))
    names = _mtp_names(list(tensors.entries))
    if not names and not Path(path_or_repo).expanduser().exists() and (sidecar := fetch_mtp_sidecar(str(path_or_repo))):
        return load_mtp(sidecar, model)  # a hub GGUF without the head: the repo's mtp-*.gguf beside it
    if not names:
        raise MlxformerError(
            f"{path.name} has no multi-token-prediction weights (mtp.*, a GGUF's nextn block): --mtp needs a "
            "checkpoint that ships them (the hub's Qwen3.5/3.6 and Qwen3-Next, their GGUFs converted by llama.cpp "
            "without --no-mtp, or its --mtp file as --mtp FILE; mlx-lm conversions drop them)")
    embedding = tensors.entries.get("model.embed_tokens.weight")
    if embedding is not None and embedding.shape[0] != model.args.vocab_size:
        raise MlxformerError(f"{path.name}: its MTP head is for a vocabulary of {embedding.shape[0]} tokens, "
                             f"the model's has {model.args.vocab_size}")
    tensors = tensors.subset(names).renamed(names)
    layers = {int(n.split(".")[1]) for n in tensors.entries if n.startswith("layers.") and n.split(".")[1].isdigit()}
    head = MTPHead(model.args, len(layers))
    if model.args.num_experts:
        tensors = tensors.stacked(expert_groups(tensors.entries, model.args.num_experts))
    quantization = quantization_of(config)
    if quantization:
        quantize_like_checkpoint(head, {_mtp_names([k]).get(k, k): v for k, v in quantization.items()}, tensors.entries)
    check_weights(head, tensors.entries)
    head.load_weights([(name, tensors[name]) for name in tensors], strict=True)
    cast_except_quantized_linears(head, model.model.norm.weight.dtype)
    head.eval()
    mx.eval(head.parameters())  # evaluated here: an engine's thread may not evaluate lazy weights of this one
    return MTPDrafter(model, head)


class HiddenRows:
    """The target's final hidden rows by position, as its latest forwards computed them."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, mx.array]] = []  # (first position, rows (L, hidden)), in order

    @property
    def end(self) -> int:
        """One past the last position held (0 when empty)."""
        return self.segments[-1][0] + self.segments[-1][1].shape[0] if self.segments else 0

    def write(self, start: int, rows: mx.array) -> None:
        """Rows ``(L, hidden)`` of positions ``start...``: a forward there means the cache was
        rewound to ``start``, so every row from ``start`` on is replaced."""
        self._cut(start)
        self.segments.append((start, rows))

    def _cut(self, end: int) -> None:
        kept = []
        for start, rows in self.segments:
            if start < end:
                kept.append((start, rows[: end - start]))
        self.segments = kept

    def run_start(self) -> int:
        """The first position of the gapless run of rows that ends at ``end``."""
        start = self.end
        for first, rows in reversed(self.segments):
            if first + rows.shape[0] != start:
                break
            start = first
        return start

    def read(self, start: int, end: int) -> mx.array:
        """Rows of positions ``start..end-1`` ``(end - start, hidden)`` (all held)."""
        parts = [rows[max(start - first, 0): end - first] for first, rows in self.segments
                 if first < end and first + rows.shape[0] > start]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def drop_before(self, position: int) -> None:
        """Forget the rows of positions before ``position``."""
        self.segments = [(max(first, position), rows[max(position - first, 0):]) for first, rows in self.segments
                         if first + rows.shape[0] > position]


class MTPDrafter:
    """A model's MTP head: makes proposers and routes the model's hidden states to them."""

    def __init__(self, model: Model, head: MTPHead) -> None:
        self.model, self.head = model, head
        self._followers: weakref.WeakValueDictionary[int, MTPProposer] = weakref.WeakValueDictionary()
        model.watch_hidden(self._observe)

    def new_proposer(self, settings: CacheSettings | None) -> MTPProposer:
        """A proposer with its own MTP-layer cache built from ``settings``."""
        return MTPProposer(self, settings, make_cache(self.head, settings))

    def follow(self, proposer: MTPProposer, cache: Sequence[Cache]) -> None:
        """Route the hidden states of forwards over ``cache`` to ``proposer`` (only)."""
        if proposer.target is not None and self._followers.get(id(proposer.target)) is proposer:
            del self._followers[id(proposer.target)]
        proposer.target = cache
        self._followers[id(cache)] = proposer

    def _observe(self, hidden: mx.array, cache: Sequence[Cache]) -> None:
        proposer = self._followers.get(id(cache))
        if proposer is None or proposer.target is not cache or hidden.shape[0] != 1 or not cache:
            return  # another sequence's, a batch's or a packed step's forward
        end = cache[-1].offset
        if isinstance(end, int):
            proposer.rows.write(end - hidden.shape[1], hidden[0])

    def embed(self, tokens: mx.array) -> mx.array:
        """The main model's embeddings of ``tokens`` ``(B, L)`` -> ``(B, L, hidden)`` (``Model.embed``:
        scaled as its first layer gets them; MTP models have no learned positions)."""
        return self.model.embed(tokens)[0]


@dataclass
class MTPProposer:
    """One sequence's MTP drafts (see the module docstring)."""

    drafter: MTPDrafter
    settings: CacheSettings | None  # to rebuild the MTP layer's cache
    cache: list[Cache]  # the MTP layer's: entries at positions ``start..fed-1``, then ``chained`` drafts
    distribution: Distribution | None = None  # None: greedy drafts
    next_key: KeySource | None = None
    target: Sequence[Cache] | None = None  # the target caches followed
    rows: HiddenRows = field(default_factory=HiddenRows)
    seen: list[int] = field(default_factory=list)  # the history of the last proposal
    start: int = 0
    fed: int = 0
    chained: int = 0

    def bind(self, distribution: Distribution | None, next_key: KeySource | None) -> None:
        self.distribution, self.next_key = distribution, next_key

    def follow(self, cache: Sequence[Cache]) -> None:
        self.drafter.follow(self, cache)

    def _restart(self, position: int) -> None:
        self.cache, self.start, self.fed, self.chained = make_cache(self.drafter.head, self.settings), position, position, 0

    def _sync(self, end: int, history: Sequence[int]) -> bool:
        """Make the MTP cache hold valid entries up to at most ``end - 1`` (trimming the last
        round's chained drafts and every entry whose next token changed), so that feeding the
        rest up to ``end - 1`` gives the first draft; False when those rows are not there."""
        first = self.rows.run_start()
        if end < 1 or self.rows.end < end or first > end - 1:
            return False
        keep = min(self.fed, common_prefix_length(self.seen, history) - 1, end - 1)
        drop = self.fed + self.chained - keep
        if keep <= self.start or (drop > 0 and any(c.trim(drop) != drop for c in self.cache)):
            self._restart(first)
        else:
            self.fed, self.chained = keep, 0
        if first > self.fed:  # the watch missed the rows in between: start the MTP context there
            self._restart(first)
        return True

    def read(self, proposed: list[int]) -> None:
        return None  # the next round trims by ``history`` alone

    def propose(self, history: Sequence[int], k: int) -> tuple[mx.array | list[int], mx.array | None]:
        end = len(history) - 1  # the target's cache holds positions 0..end-1, whose rows are wanted
        if k < 1 or not self._sync(end, history):
            return [], None
        head, step, fed = self.drafter.head, default_prefill_step(), self.fed
        ids = mx.array(history[fed + 1: end + 1], mx.int32)  # the x_{p+1} to feed (not the whole history)
        for at in range(fed, end, step):  # (x_{p+1}, h_p) for p in fed..end-1, in chunks
            stop = min(at + step, end)
            g = head(self.drafter.embed(ids[None, at - fed: stop - fed]), self.rows.read(at, stop)[None], self.cache)
            if stop < end:
                mx.eval([c.state for c in self.cache])
        g = g[:, -1:, :]  # (1, 1, hidden): the MTP state at the target's last position
        tokens: list[mx.array] = []
        probs: list[mx.array] = []
        for i in range(k):
            token, p = draft_token(self.drafter.model.logits(g)[:, -1, :], self.distribution, self.next_key)
            tokens.append(token)
            if p is not None:
                probs.append(p)
            if i + 1 < k:
                g = head(self.drafter.embed(token[None]), g, self.cache)  # (1, 1, hidden)
        proposed = mx.concatenate(tokens).astype(mx.int32)  # (k,): read with the verification
        self.fed, self.chained, self.seen = end, k - 1, list(history)
        self.rows.drop_before(end - 1)  # the last one may be fed again (a changed next token)
        return proposed, (mx.stack(probs) if probs else None)

