#!/usr/bin/env bash
# System packages the test suite needs beyond pip: Debian's chromium for the chat page's browser
# test (driven by Playwright through the system browser; never `playwright install`).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_test_deps: no apt-get here; install Chromium and set MLXFORMER_CHROMIUM to its path" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
