#!/usr/bin/env bash
# Sets up a fresh machine: redis-server (apt), a virtual environment in .venv with the CPU
# build of torch and osd installed in editable mode with its dev extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "==> installing redis-server"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q redis-server >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: the CPU build (an unpinned torch may pull a multi-GB CUDA build).
# On GPU machines install the CUDA build of torch before running this script.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "==> installing torch (${OSD_TORCH_SPEC:-torch==2.13.0})"
  .venv/bin/python -m pip install -q "${OSD_TORCH_SPEC:-torch==2.13.0}"
fi
echo "==> installing osd[dev]"
.venv/bin/python -m pip install -q -e '.[dev]'
echo "==> ready: $(.venv/bin/python -c 'import osd, torch, transformers; print("osd", "torch", torch.__version__, "transformers", transformers.__version__)')"
