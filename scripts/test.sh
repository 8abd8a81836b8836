#!/usr/bin/env bash
# The test suite (README's test command): runs on CPU in minutes, against a real redis-server.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
