#!/usr/bin/env bash
# Installs what the test suite needs beyond the Rust toolchain, then exits:
# the OpenAI Python SDK (tests/python_sdk.rs), Debian's Chromium and
# playwright-core (tests/browser.rs), curl (an HTTP/2 client in
# tests/proxy.rs). node and python3 come with the machine.
# Safe to run again: each step is skipped or quick when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v node >/dev/null || { echo "test-setup: node is missing (tests/oracle.rs and tests/browser.rs need it)"; exit 1; }
command -v python3 >/dev/null || { echo "test-setup: python3 is missing (tests/python_sdk.rs needs it)"; exit 1; }

export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install --quiet 'openai>=1.40,<3'

# Never a browser download: Debian's package.
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v curl >/dev/null || missing+=(curl)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
npm ci --prefix tests/browser --no-audit --no-fund --silent
