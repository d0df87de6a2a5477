"""A few hundred mutated GGUF headers: each loads or gives a one-line MlxformerError, quickly.

The files are mutations (seeded) of a small valid GGUF written by gguf-py: bytes flipped in
the header, counts and lengths overwritten with absurd values, truncations, and targeted
edits (alignment, tensor offsets, types, dimensions). They are loaded in a subprocess, so a
crash (segfault, abort) fails the test instead of killing pytest, and with a time bound.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from conftest import write_tiny_checkpoint
from gguf_helpers import write_gguf_from_hf

N_FILES = 300
PER_FILE_SECONDS = 3.0
EXTREMES = [0, 1, 7, 255, 2**31 - 1, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**64 - 1]

_LOADER = """
import json, sys, time, traceback
from pathlib import Path
from mlxformer.errors import MlxformerError
from mlxformer.loader import build_model, read_checkpoint

results = []
for path in sorted(Path(sys.argv[1]).glob("*.gguf")):
    start = time.perf_counter()
    try:
        config, weights, _ = read_checkpoint(path)
        build_model(config, weights)
        outcome = "ok"
    except MlxformerError as exc:
        outcome = "error: " + str(exc)
    except BaseException:
        print(json.dumps({"file": path.name, "traceback": traceback.format_exc()}))
        sys.exit(3)
    results.append({"file": path.name, "outcome": outcome, "seconds": time.perf_counter() - start})
print(json.dumps(results))
"""


def _header_end(path: Path) -> int:
    """Where the tensor data starts (the header is everything before)."""
    reader = gguf.GGUFReader(str(path))
    return int(reader.data_offset)


def _mutations(base: bytes, header_end: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    reader_fields = _field_offsets(base)
    out = []
    for i in range(N_FILES):
        data = bytearray(base)
        kind = i % 6
        if kind == 0:  # flip a few header bytes
            for pos in rng.integers(4, header_end, size=rng.integers(1, 4)):
                data[pos] ^= int(rng.integers(1, 256))
        elif kind == 1:  # an absurd 8-byte value anywhere in the header
            pos = int(rng.integers(4, header_end - 8))
            data[pos : pos + 8] = struct.pack("<Q", EXTREMES[int(rng.integers(len(EXTREMES)))])
        elif kind == 2:  # an absurd value at a length/count/offset field
            pos, size = reader_fields[int(rng.integers(len(reader_fields)))]
            value = EXTREMES[int(rng.integers(len(EXTREMES)))] % (1 << (8 * size))
            data[pos : pos + size] = value.to_bytes(size, "little")
        elif kind == 3:  # truncated, in the header or in the data
            data = data[: int(rng.integers(0, len(base)))]
        elif kind == 4:  # an absurd 4-byte value (types, dimension counts)
            pos = int(rng.integers(4, header_end - 4))
            data[pos : pos + 4] = struct.pack("<I", [0, 5, 9, 13, 31, 40, 2**31, 2**32 - 1][int(rng.integers(8))])
        else:  # bytes inserted or deleted in the header
            pos = int(rng.integers(4, header_end))
            data = data[:pos] + bytes(rng.integers(0, 256, size=int(rng.integers(1, 9)), dtype=np.uint8)) + data[pos:] \
                if rng.random() < 0.5 else data[:pos] + data[pos + int(rng.integers(1, 9)) :]
        out.append(bytes(data))
    return out


def _field_offsets(base: bytes) -> list[tuple[int, int]]:
    """(position, size) of every count, length, type, dimension and offset field of the header,
    from gguf-py's reader (its parts are numpy views into the file's bytes)."""
    reader = gguf.GGUFReader(_tmp_file(base))
    positions = []
    for holder in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        for part in holder.parts:
            if part.dtype.kind in "ui" and part.size == 1 and part.itemsize in (4, 8):
                offset = part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]
                if 0 <= offset < len(base):
                    positions.append((offset, part.itemsize))
    return positions


def _tmp_file(data: bytes) -> str:
    import tempfile

    handle = tempfile.NamedTemporaryFile(suffix=".gguf", delete=False)
    handle.write(data)
    handle.close()
    return handle.name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fuzz")
    _, hf_model = write_tiny_checkpoint(directory / "hf", "llama", hidden_size=32, intermediate_size=64)
    base_path = directory / "base.gguf"
    write_gguf_from_hf(base_path, hf_model, "llama", lambda name, shape: T.Q8_0 if "ffn" in name else T.F16)
    base = base_path.read_bytes()
    files = directory / "files"
    files.mkdir()
    (files / "000-base.gguf").write_bytes(base)
    for i, data in enumerate(_mutations(base, _header_end(base_path), seed=10)):
        (files / f"{i + 1:03d}.gguf").write_bytes(data)
    return files


def test_fuzzed_headers_give_one_line_errors_only(corpus):
    proc = subprocess.run([sys.executable, "-c", _LOADER, str(corpus)], capture_output=True, text=True,
                          timeout=N_FILES * PER_FILE_SECONDS)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])  # no crash
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == N_FILES + 1 and results[0]["outcome"] == "ok"  # the unmutated file loads
    errors = [r["outcome"] for r in results if r["outcome"] != "ok"]
    assert len(errors) > N_FILES // 2  # most mutations are caught, not silently loaded
    assert all("\n" not in e and len(e) < 400 for e in errors)
    assert max(r["seconds"] for r in results) < PER_FILE_SECONDS
