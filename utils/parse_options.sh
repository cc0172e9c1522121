#!/usr/bin/env bash
# Kaldi-style option parsing; source it after declaring the script's variables:
#
#   stage=0          # first stage to run
#   nj=4             # parallel jobs
#   . utils/parse_options.sh
#
# Every variable declared before it can then be set as `--name value` or
# `--name=value` (dashes in the option name map to underscores). Booleans take
# `true` or `false`. `--help` prints the script's leading comment block and
# the current value of each option. Options must precede positional
# arguments; an option that names no declared variable is an error.

__po_help() {
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
}

while [ $# -gt 0 ]; do
  case "$1" in
    --help|-h)
      __po_help
      exit 0 ;;
    --*=*)
      __po_name=${1%%=*}; __po_value=${1#*=}; shift ;;
    --*)
      __po_name=$1
      if [ $# -lt 2 ]; then
        echo "$0: option $1 needs a value" >&2; exit 1
      fi
      __po_value=$2; shift 2 ;;
    *) break ;;
  esac
  __po_var=${__po_name#--}
  __po_var=${__po_var//-/_}
  if ! [[ $__po_var =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || [ -z "${!__po_var+set}" ]; then
    echo "$0: unknown option $__po_name" >&2; exit 1
  fi
  case "${!__po_var}" in
    true|false)
      if [ "$__po_value" != true ] && [ "$__po_value" != false ]; then
        echo "$0: option $__po_name takes true or false, got '$__po_value'" >&2; exit 1
      fi ;;
  esac
  printf -v "$__po_var" '%s' "$__po_value"
done
unset __po_name __po_value __po_var
true
