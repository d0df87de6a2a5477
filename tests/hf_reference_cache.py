"""transformers' own conversion of a GGUF (its float32 model, its tokenizer), done once per GGUF
and library versions and kept on disk, so each xdist worker (and each run) reloads transformers'
``save_pretrained`` output in a fraction of a second instead of re-dequantizing the file.

The cached files are what transformers produced from the GGUF; the tests compare against them
exactly as against a fresh conversion (a float32 save/reload is bit-exact)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

DONE = "complete"  # written last: a directory without it is an interrupted build


def cache_root() -> Path:
    """``$MLXFORMER_TEST_CACHE`` (default ``~/.cache/mlxformer-test``)."""
    return Path(os.environ.get("MLXFORMER_TEST_CACHE", Path.home() / ".cache" / "mlxformer-test"))


def _key(gguf_path: Path, kind: str) -> str:
    """SHA-256 of the file, its size, and the versions of the libraries that convert it."""
    import gguf
    import tokenizers
    import torch
    import transformers

    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    versions = f"{kind}|{gguf_path.stat().st_size}|{transformers.__version__}|{torch.__version__}|" \
               f"{gguf.__version__ if hasattr(gguf, '__version__') else ''}|{tokenizers.__version__}"
    return hashlib.sha256(digest.hexdigest().encode() + versions.encode()).hexdigest()[:24]


def _cached(gguf_path: Path, kind: str, build: Callable[[Path], None]) -> Path:
    """The directory holding ``build``'s output for this GGUF, building it under a file lock
    (other workers wait, then reuse it) into a temporary directory renamed into place."""
    from filelock import FileLock

    root = cache_root() / "hf-from-gguf"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{gguf_path.stem}-{kind}-{_key(gguf_path, kind)}"
    if (target / DONE).exists():
        return target
    with FileLock(str(target) + ".lock"):
        if not (target / DONE).exists():
            shutil.rmtree(target, ignore_errors=True)
            scratch = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
            try:
                build(scratch)
                (scratch / DONE).write_text("")
                os.replace(scratch, target)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return target


def hf_tokenizer_from_gguf(gguf_path: Path):
    """``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, through the disk cache."""
    from transformers import AutoTokenizer

    def build(directory: Path) -> None:
        AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(directory)

    return AutoTokenizer.from_pretrained(str(_cached(gguf_path, "tokenizer", build)))


def hf_model_from_gguf(gguf_path: Path):
    """transformers' float32 model from the GGUF (weights dequantized by transformers), in eval
    mode, through the disk cache."""
    import torch
    from transformers import AutoModelForCausalLM

    def build(directory: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        # Weights are plain dequantized tensors now; drop the GGUF "quantizer" so transformers saves them.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(directory)

    directory = _cached(gguf_path, "model", build)
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
