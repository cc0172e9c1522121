# Logging helper for stage scripts; source it.
#   log "Stage 1: features"   ->  2026-11-21 10:00:00 (run.sh:42:main) Stage 1: features
log() {
  local fname=${BASH_SOURCE[1]##*/}
  echo -e "$(date '+%Y-%m-%d %H:%M:%S') (${fname}:${BASH_LINENO[0]}:${FUNCNAME[1]}) $*" >&2
}
