"""The OpenAPI document tells the truth: schemathesis (``--checks all``: no 5xx, only documented
status codes and content types, every response and SSE event valid against its declared schema,
schema-invalid requests rejected) fuzzes every route of a live server on 127.0.0.1, bounded in
examples and time, over a tiny model with a 96-token context so each generation is short."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server_support import running_engine

CONFIG = Path(__file__).parent / "data" / "schemathesis.toml"
CONTEXT = 96
MAX_SECONDS = 60  # schemathesis's own budget for fuzzing


@pytest.mark.xfail(reason="known defect, open in issue 19: /apply-template and /detokenize (added late) answer "
                          "status codes their OpenAPI entries do not document", strict=False)
def test_schemathesis_finds_nothing(tiny_smol):
    from mlxformer import load
    from mlxformer.server.app import create_app
    from mlxformer.server.runner import ServerThread
    from mlxformer.server.translate import ServedModel

    model, tokenizer = load(tiny_smol[0], threads=1)
    with running_engine(model, tokenizer, max_batch=4) as engine:
        served = ServedModel("tiny", tokenizer, CONTEXT, model.args.vocab_size)
        with ServerThread(create_app(engine, served)) as server:
            result = subprocess.run(
                [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
                 f"{server.url}/openapi.json", "--checks", "all", "--max-examples", "8", "--seed", "1",
                 "--max-time", str(MAX_SECONDS), "--request-timeout", "60", "--workers", "2", "--no-shrink",
                 "--phases", "examples,fuzzing"],  # the coverage phase takes minutes here: run by hand (design notes)
                capture_output=True, text=True, timeout=MAX_SECONDS * 4,
            )
    report = result.stdout[result.stdout.find("=== ERRORS") if "=== ERRORS" in result.stdout else -6000:]
    assert result.returncode == 0, report[:6000] + result.stderr[-2000:]
    assert "Tested: 4" in result.stdout  # every operation was exercised
