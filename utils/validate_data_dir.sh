#!/usr/bin/env bash
# Validate a Kaldi data directory (sorted unique tables, consistent utterances, speakers,
# segments and features); prints every problem found and exits 1 if there is any.
# Expects the project environment (path.sh) to be active.
#
# Usage: utils/validate_data_dir.sh [--no-text] [--no-wav] [--require-feats] <data-dir>
set -euo pipefail
exec python -m cat.data.datadir validate "$@"
