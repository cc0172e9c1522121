#!/usr/bin/env bash
# The project's test command: installs what it needs, then lints and tests.
#
# Usage: bash tests/run.sh [--fast] [pytest args]
#   --fast   the quick tier for iterating: leaves out the tests marked slow (end-to-end
#            recipe runs, fault drills with real servers, DDP); CI runs everything
#
# pytest runs in parallel (pytest-xdist): $CAT_TEST_WORKERS processes (default: the CPUs
# plus one, at least 3 and at most 8; the tests mostly wait on subprocesses, servers and
# timeouts), each test file on one worker, the tests sharing a machine-wide resource on one
# worker (tests/conftest.py). Given a test path, or -n / --dist / -p no:xdist itself, it
# runs as told, serially unless -n says otherwise; `-n 0` runs the whole suite serially:
#   bash tests/run.sh -n 0                    # everything, one test at a time
#   bash tests/run.sh tests/decoding -k foo   # serially
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
marker=()
if [ "${1:-}" = "--fast" ]; then
  shift
  marker=(-m "not slow")
fi
bash tools/install.sh --dev
# shellcheck disable=SC1091
. ./path.sh

echo "== ruff"
ruff check .
echo "== shellcheck"
git ls-files -z -- '*.sh' .ci/run | xargs -0 shellcheck -x
echo "== pytest"
cpus=$(nproc 2>/dev/null || echo 2)
workers=${CAT_TEST_WORKERS:-$(( cpus + 1 < 3 ? 3 : (cpus + 1 > 8 ? 8 : cpus + 1) ))}
parallel=()
if python -c "import xdist" 2>/dev/null; then  # installed by tools/install.sh --dev
  parallel=(-n "$workers" --dist loadgroup)
fi
for arg in "$@"; do
  path=${arg%%::*}
  case $arg in
    -n | -n* | --numprocesses* | --dist* | no:xdist | -pno:xdist) parallel=() ;;
    -*) ;;
    *) if [ -d "$path" ] || { [[ $path == *.py ]] && [ -f "$path" ]; }; then parallel=(); fi ;;
  esac
done
python -m pytest -q "${parallel[@]}" "${marker[@]}" "$@"
