#!/usr/bin/env bash
# Builds kenlm programs into tools/bin/ from the C++ source in kenlm's source package on
# PyPI (the `kenlm` Python module only queries models):
#
# * build_binary (the default): ARPA -> kenlm binary, which loads in milliseconds and, as
#   a trie, takes less memory. Needs g++ only.
# * lmplz: kenlm's n-gram estimator (lm/builder), which sorts on disk within a memory
#   budget (lm.json "memory"), so a model's size is not bounded by the machine's memory.
#   cat.lm.train uses it when it is built. Needs Boost (program_options, thread, system).
#
# zlib headers are optional: with them gzipped text and ARPA files are read too. The
# sources compile with -O2, in parallel over the usable CPUs.
#
# Usage: bash tools/build_kenlm_binary.sh               # build_binary
#        bash tools/build_kenlm_binary.sh lmplz         # lmplz
#        bash tools/build_kenlm_binary.sh build_binary lmplz
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$root/tools/venv/bin/python
bin=$root/tools/bin

log() { echo "$(date '+%Y-%m-%d %H:%M:%S') (build_kenlm_binary.sh:${BASH_LINENO[0]}) $*" >&2; }

programs=("$@")
[ ${#programs[@]} -gt 0 ] || programs=(build_binary)
todo=()
for program in "${programs[@]}"; do
  case $program in
    build_binary | lmplz) ;;
    *) echo "ERROR: unknown kenlm program '$program' (build_binary, lmplz)" >&2; exit 1 ;;
  esac
  if [ -x "$bin/$program" ]; then
    log "$bin/$program already built"
  else
    todo+=("$program")
  fi
done
[ ${#todo[@]} -gt 0 ] || exit 0

libs=(-lpthread)
if [[ " ${todo[*]} " == *" lmplz "* ]]; then
  for header in boost/program_options.hpp boost/thread/thread.hpp boost/system/error_code.hpp; do
    if ! echo "#include <$header>" | g++ -E -x c++ - >/dev/null 2>&1; then
      echo "ERROR: lmplz needs Boost's headers ($header is missing): apt-get install" \
           "libboost-program-options-dev libboost-thread-dev libboost-system-dev" >&2
      exit 1
    fi
  done
  libs=(-lboost_program_options -lboost_thread -lboost_system "${libs[@]}")
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
if echo '#include <zlib.h>' | g++ -E -x c++ - >/dev/null 2>&1; then
  flags+=(-DHAVE_ZLIB)
  libs+=(-lz)
fi
cd "$src"
# Only the sources the programs need: the query library (util, lm) for both, and the
# streaming sort and estimator (util/stream, lm/common, lm/builder) for lmplz.
directories=(util util/double-conversion lm)
[[ " ${todo[*]} " == *" lmplz "* ]] && directories+=(util/stream lm/common lm/builder)
sources=()
for directory in "${directories[@]}"; do
  for file in "$directory"/*.cc; do
    case $file in
      *main.cc | *test.cc) ;;
      *) sources+=("$file") ;;
    esac
  done
done
jobs=$(nproc 2>/dev/null || echo 1)
log "compiling ${#sources[@]} files for ${todo[*]} with $jobs jobs (a few minutes)"
# shellcheck disable=SC2016  # $0 and $@ expand in the inner shell, once per source
printf '%s\n' "${sources[@]}" | xargs -P "$jobs" -I{} \
  sh -c 'g++ "$@" -I. -c "$0" -o "$0.o"' {} "${flags[@]}"
objects=("${sources[@]/%/.o}")
mkdir -p "$bin"
for program in "${todo[@]}"; do
  main=lm/build_binary_main.cc
  [ "$program" = lmplz ] && main=lm/builder/lmplz_main.cc
  g++ "${flags[@]}" -I. "$main" "${objects[@]}" -o "$bin/$program.tmp" "${libs[@]}"
  mv "$bin/$program.tmp" "$bin/$program"
  log "built $bin/$program"
done
