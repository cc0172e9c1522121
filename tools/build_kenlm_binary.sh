#!/usr/bin/env bash
# Builds kenlm's `build_binary` (ARPA -> kenlm binary, which loads in milliseconds and,
# as a trie, takes less memory) into tools/bin/. The `kenlm` Python module does not ship
# it; its source package on PyPI holds the C++ source, which compiles without Boost.
# Needs g++ (zlib headers optional: with them gzipped ARPA files are read too).
#
# Usage: bash tools/build_kenlm_binary.sh      # then lm.json: "binary": "probing" | "trie"
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$root/tools/venv/bin/python
out=$root/tools/bin/build_binary

log() { echo "$(date '+%Y-%m-%d %H:%M:%S') (build_kenlm_binary.sh:${BASH_LINENO[0]}) $*" >&2; }

if [ -x "$out" ]; then
  log "$out already built"
  exit 0
fi
version=$("$python" -c 'import importlib.metadata as m; print(m.version("kenlm"))')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log "downloading the kenlm $version source package"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary kenlm \
  "kenlm==$version" -d "$work"
tar xzf "$work"/kenlm-*.tar.gz -C "$work"
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'kenlm-*')
flags=(-O2 -DNDEBUG -DKENLM_MAX_ORDER=6 -std=c++11 -w)
libs=(-lpthread)
if echo '#include <zlib.h>' | g++ -E -x c++ - >/dev/null 2>&1; then
  flags+=(-DHAVE_ZLIB)
  libs+=(-lz)
fi
cd "$src"
sources=()
for file in util/*.cc util/double-conversion/*.cc lm/*.cc; do
  case $file in
    *main.cc | *test.cc) ;;
    *) sources+=("$file") ;;
  esac
done
log "compiling build_binary from ${#sources[@]} files (a few minutes)"
mkdir -p "$(dirname "$out")"
g++ "${flags[@]}" -I. "${sources[@]}" lm/build_binary_main.cc -o "$out.tmp" "${libs[@]}"
mv "$out.tmp" "$out"
log "built $out"
