"""Run by tests/test_gguf_families.py: llama.cpp's own ``convert_hf_to_gguf.py`` (unmodified,
from the llama-cpp-python sdist) on several checkpoints in one interpreter, so torch and
transformers are imported once. Each job is the converter's own command line
``DIR --outtype T --outfile F`` and gets the converter's own modules afresh (its flags, e.g.
``--no-mtp`` and ``--mtp``, are set on the model classes, and would otherwise stay for the next
jobs); one JSON line per job says whether it succeeded (if not, its last error line) and the CPU
seconds it took.

Usage: python convert_driver.py CONVERTER JOBS.json RESULTS.jsonl
"""

from __future__ import annotations

import json
import runpy
import sys
import time
import traceback
from pathlib import Path


def main() -> None:
    converter, jobs, results = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    sys.path.insert(0, str(converter.parent))  # its ``conversion`` package
    with results.open("w") as out:
        for job in jobs:
            for name in [m for m in sys.modules if m == "conversion" or m.startswith("conversion.")]:
                del sys.modules[name]  # fresh model classes: the converter's flags are class attributes
            sys.argv = [str(converter), *job["argv"]]
            start = time.process_time()
            try:
                runpy.run_path(str(converter), run_name="__main__")
                error = None
            except SystemExit as exit_:
                error = None if exit_.code in (None, 0) else f"exit {exit_.code}"
            except Exception as exc:  # the converter refused this checkpoint: recorded, next job
                error = traceback.format_exception_only(exc)[-1].strip()
            out.write(json.dumps({"name": job["name"], "error": error, "cpu_s": time.process_time() - start}) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
