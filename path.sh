# shellcheck shell=bash
# Environment for the recipes: source it, do not execute it.
#   . ../../path.sh      (from egs/<corpus>/)
# Activates the virtual environment made by tools/install.sh and puts the
# `cat` package and the Kaldi-style helpers in utils/ on the paths.

CAT_ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
export CAT_ROOT

if [ ! -x "$CAT_ROOT/tools/venv/bin/python" ]; then
  echo "ERROR: no virtual environment at $CAT_ROOT/tools/venv; run: bash $CAT_ROOT/tools/install.sh" >&2
  # shellcheck disable=SC2317  # exit is reached only when the file is executed
  return 1 2>/dev/null || exit 1
fi
# shellcheck disable=SC1091
. "$CAT_ROOT/tools/venv/bin/activate"

export PYTHONPATH="$CAT_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$CAT_ROOT/utils:$PATH"
# Byte-order sorting everywhere, as Kaldi data directories require.
export LC_ALL=C
export PYTHONIOENCODING=utf-8
