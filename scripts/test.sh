#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Fails when any test fails or when none ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --vllm
.venv/bin/ruff check src tests
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$status"
