#!/usr/bin/env bash
# The project's test command: installs what it needs, then lints and tests.
#
# Usage: bash tests/run.sh [--fast] [pytest args]
#   --fast   the quick tier for iterating: leaves out the tests marked slow (end-to-end
#            recipe runs, fault drills with real servers, DDP); CI runs everything
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
python -m pytest -q "${marker[@]}" "$@"
