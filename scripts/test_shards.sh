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
# TANDEM_TEST_SUITE (default: tests), TANDEM_TEST_SHARD_A and TANDEM_TEST_IN_B (space-separated; default: the
# lists below; IN_B is empty when only SHARD_A is given) name other paths; tests/test_shards.py runs the script
# on a small suite of its own that way.
set -uo pipefail
cd "$(dirname "$0")/.."

# Shard A runs SHARD_A's paths but IN_B, and shard B every other test, so a new test file always runs
# somewhere. Chosen from `pytest --durations` so that both shards take about as long: the Ray runs of
# tests/orchestrator in A, except the stop tests (each starts a cluster of its own), which evened the two out
# (docs/results.md, 2026-11-30).
SHARD_A=(
  tests/orchestrator
)
IN_B=(
  tests/orchestrator/test_stop.py
)
SUITE=${TANDEM_TEST_SUITE:-tests}
if [ -n "${TANDEM_TEST_SHARD_A:-}" ]; then
  read -r -a SHARD_A <<< "$TANDEM_TEST_SHARD_A"
  read -r -a IN_B <<< "${TANDEM_TEST_IN_B:-}"
fi

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

a_args=("${SHARD_A[@]}")
for path in "${IN_B[@]}"; do a_args+=("--ignore=$path"); done
# B ignores each test file under A's paths but IN_B (pytest drops a path argument inside another one, so
# naming IN_B's files beside the suite would not run them)
b_args=("$SUITE")
while IFS= read -r file; do
  for moved in "${IN_B[@]}"; do [ "$file" = "$moved" ] && continue 2; done
  b_args+=("--ignore=$file")
done < <(find "${SHARD_A[@]}" -type f \( -name 'test_*.py' -o -name '*_test.py' \) | sort)
run_shard A "${a_args[@]}" &
a=$!
run_shard B "${b_args[@]}" &
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
