#!/usr/bin/env bash
# Run the test suite as two pytest processes at once (scripts/test.sh calls this after setup). Fails when
# either shard fails, collects no tests, or cannot start.
#
# Isolation: each shard runs in its own mount namespace (`unshare --mount`) with a fresh tmpfs on /dev/shm,
# and with TMPDIR set to a directory of its own, which Ray also uses for its sessions and its
# ray_current_cluster file. So each shard's sandboxes, overlay mounts, host shares, Ray cluster and its
# "nothing left behind" checks see only that shard's processes; cgroups and sandbox directories carry the
# owning process id in their names, so the sweeps of stale ones never take the other shard's.
#
#   bash scripts/test_shards.sh                run both shards, print each line prefixed [A] or [B]
#   bash scripts/test_shards.sh --can-isolate  exit 0 when this machine can (root and a working `unshare`)
#
# TANDEM_TEST_SUITE (default: tests) and TANDEM_TEST_SHARD_A (space-separated; default: the list below) name
# other paths; tests/test_shards.py runs the script on a small suite of its own that way.
set -uo pipefail
cd "$(dirname "$0")/.."

# Shard A runs these paths and shard B every other test, so a new test file always runs somewhere. Chosen from
# one process's `pytest --durations` so that both shards take about as long (docs/results.md, 2026-11-30).
SHARD_A=(
  tests/orchestrator
)
SUITE=${TANDEM_TEST_SUITE:-tests}
if [ -n "${TANDEM_TEST_SHARD_A:-}" ]; then read -r -a SHARD_A <<< "$TANDEM_TEST_SHARD_A"; fi

if [ "${1:-}" = --can-isolate ]; then
  [ "$(id -u)" = 0 ] && command -v unshare > /dev/null && unshare --mount --propagation private true 2> /dev/null
  exit $?
fi

root=$(mktemp -d /tmp/ts.XXXXXX)
chmod 0755 "$root"  # sandboxes run as another user, who must reach their directories under each TMPDIR
trap 'kill 0 2> /dev/null' INT TERM

run_shard() {  # NAME PYTEST-ARGS...: one shard, its pytest exit status written to $root/NAME/status
  local name=$1
  shift
  mkdir -p "$root/$name/tmp"
  chmod 1777 "$root/$name/tmp"  # as /tmp
  unshare --mount --propagation private -- env TMPDIR="$root/$name/tmp" PYTHONUNBUFFERED=1 bash -c '
    status_file=$1; shift
    if ! mount -t tmpfs -o mode=1777 shm /dev/shm; then echo "error: cannot mount a tmpfs on /dev/shm"; exit; fi
    start=$SECONDS
    .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
    status=$?
    echo "shard took $((SECONDS - start)) s, pytest exit status $status"
    echo "$status" > "$status_file"' shard "$root/$name/status" "$@" 2>&1 | sed -u "s/^/[$name] /"
}

ignores=()
for path in "${SHARD_A[@]}"; do ignores+=("--ignore=$path"); done
run_shard A "${SHARD_A[@]}" &
a=$!
run_shard B "$SUITE" "${ignores[@]}" &
b=$!
wait "$a" "$b"

status=0
for name in A B; do
  code=$(cat "$root/$name/status" 2> /dev/null || echo "none")
  if [ "$code" = 0 ]; then
    continue
  elif [ "$code" = 5 ]; then
    echo "error: shard $name collected no tests" >&2
  else
    echo "error: shard $name failed (pytest exit status: $code)" >&2
  fi
  status=1
done
if [ "$status" = 0 ]; then
  rm -rf "$root"
else
  echo "the shards' temp dirs are kept in $root" >&2
fi
exit "$status"
