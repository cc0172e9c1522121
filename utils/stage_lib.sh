# shellcheck shell=bash
# Helpers for stage scripts; source it after path.sh.

# log MESSAGE...: a timestamped line naming the calling script, line and function.
#   2026-11-21 10:00:00 (run.sh:42:main) Stage 1: features
log() {
  local fname=${BASH_SOURCE[1]##*/}
  echo -e "$(date '+%Y-%m-%d %H:%M:%S') (${fname}:${BASH_LINENO[0]}:${FUNCNAME[1]}) $*" >&2
}

# is_done MARKER [SIGNATURE]: true when MARKER exists and holds SIGNATURE, i.e. the
# step it guards finished with the same inputs. A changed signature reruns the step.
is_done() {
  [ -f "$1" ] && [ "$(cat "$1")" = "${2:-}" ]
}

# mark_done MARKER [SIGNATURE]: record that a step finished (atomically).
mark_done() {
  mkdir -p "$(dirname "$1")"
  printf '%s' "${2:-}" > "$1.tmp"
  mv "$1.tmp" "$1"
}
