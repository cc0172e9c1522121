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

# run COMMAND...: run a stage's command so that a signal to this script reaches it. SIGINT
# and SIGTERM are passed on to it as SIGTERM (training then saves and stops; the other
# stages stop, leaving nothing partial under a final name), and once it has ended the
# script ends too. Without this, a signal would end the script and leave the command
# running on its own. Returns the command's exit status.
run() {
  local child status=0 signalled=false
  "$@" &
  child=$!
  trap 'signalled=true; kill -TERM "$child" 2>/dev/null || true' INT TERM
  while :; do
    status=0
    wait "$child" || status=$?
    # wait returns early (status > 128) when a signal arrives; the command may still run
    kill -0 "$child" 2>/dev/null || break
  done
  trap - INT TERM
  if $signalled; then
    log "stopped by a signal: $* ended with status $status"
    exit $((status == 0 ? 130 : status))
  fi
  return "$status"
}

# launcher_cmd MEM TIME GPUS: Kaldi's $train_cmd (a launcher of array jobs, utils/launch.sh)
# from cmd.sh's settings (cmd_backend, partition, cpus_per_job, sbatch_options) and the
# memory, time limit and GPUs given ("" or 0: none asked).
# shellcheck disable=SC2154  # the settings come from the recipe's cmd.sh
launcher_cmd() {
  local cmd="launch.sh --backend $cmd_backend --cpus-per-job $cpus_per_job" option
  [ -n "$partition" ] && cmd+=" --partition $partition"
  [ -n "$1" ] && cmd+=" --mem-per-job $1"
  [ -n "$2" ] && cmd+=" --time-per-job $2"
  [ "${3:-0}" != 0 ] && cmd+=" --gpus-per-job $3"
  for option in $sbatch_options; do cmd+=" --sbatch-option=$option"; done
  echo "$cmd"
}
