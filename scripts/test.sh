#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Fails when any test fails or when none ran.
#
# With no arguments the suite runs as two shards at once (scripts/test_shards.sh): a one-process run of it
# left 38% of a 2-core machine idle (docs/results.md, 2026-11-30). Each shard has its own mount namespace, /dev/shm and temp dir,
# so one shard's sandboxes, Ray cluster and leftover checks never see the other's. Where that isolation is
# not possible (not root, no `unshare`), or with TANDEM_TEST_SHARDS=1, or with any pytest arguments (which
# are passed on), it runs one pytest process.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${TANDEM_TEST_SHARDS:-2}" in
  1 | 2) ;;
  *)
    echo "error: TANDEM_TEST_SHARDS=${TANDEM_TEST_SHARDS} must be 1 (one pytest process) or 2 (two shards, the default)" >&2
    exit 2
    ;;
esac
bash scripts/setup.sh --vllm
.venv/bin/ruff check src tests
if [ "$#" -eq 0 ] && [ "${TANDEM_TEST_SHARDS:-2}" != 1 ] && bash scripts/test_shards.sh --can-isolate; then
  exec bash scripts/test_shards.sh
fi
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$status"
