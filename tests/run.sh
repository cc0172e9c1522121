#!/usr/bin/env bash
# The project's test command: installs what it needs, then lints and tests.
#
# Usage: bash tests/run.sh [pytest args]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash tools/install.sh --dev
# shellcheck disable=SC1091
. ./path.sh

echo "== ruff"
ruff check .
echo "== shellcheck"
git ls-files -z -- '*.sh' .ci/run | xargs -0 shellcheck -x
echo "== pytest"
python -m pytest -q "$@"
