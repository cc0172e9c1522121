#!/usr/bin/env bash
# Kaldi-style option parsing; source it after declaring the script's variables:
#
#   stage=0          # first stage to run
#   nj=4             # parallel jobs
#   . utils/parse_options.sh
#
# Every variable declared before it (also in a file sourced as `. ./cmd.sh` from the
# current directory) can then be set as `--name value` or `--name=value` (dashes in the
# option name map to underscores). Booleans take
# `true` or `false`. `--help` prints the script's leading comment block and every
# option (a variable declared with a `# comment` before this file is sourced) with its
# current value. Options must precede positional arguments; an option that names no
# declared variable is an error, unless the script forwards options to another one:
#
#   po_forward_to=../../utils/asr.sh   # set before sourcing this file
#   . ../../utils/parse_options.sh
#   ../../utils/asr.sh ... "${po_forwarded[@]}"
#
# Then options that script declares are collected in the array `po_forwarded` (in
# order, after the script's own, so they win), and `--help` lists them too.

# The running script, also when it changed directory before sourcing this file (the
# recipes cd to their own directory, so a relative $0 may no longer resolve).
__po_script=$0
if [ ! -f "$__po_script" ]; then
  if [ -n "${OLDPWD:-}" ] && [ -f "$OLDPWD/$0" ]; then
    __po_script=$OLDPWD/$0
  else
    __po_script=$(basename "$0")
  fi
fi

# __po_options FILE: `name|default|comment` (separated by \x1f) of each option FILE declares,
# also in a file it sources as `. ./NAME.sh` (a recipe's cmd.sh) before this one.
__po_options() {
  local line rest
  while IFS= read -r line; do
    case $line in *parse_options.sh*) break ;; esac
    if [[ $line =~ ^\.[[:space:]]+\./([A-Za-z0-9_.-]+\.sh)[[:space:]]*$ ]] \
        && [ -f "${BASH_REMATCH[1]}" ]; then
      __po_options "${BASH_REMATCH[1]}"
      continue
    fi
    [[ $line =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]] || continue
    local name=${BASH_REMATCH[1]}
    rest=${BASH_REMATCH[2]}
    [[ $rest =~ ^(.*[^[:space:]]|)[[:space:]]+#[[:space:]]?(.*)$ ]] || continue
    printf '%s\x1f%s\x1f%s\n' "$name" "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
  done < "$1"
}

# __po_print_options FILE CURRENT: an aligned list; CURRENT=true shows current values.
__po_print_options() {
  local name default comment value
  while IFS=$'\x1f' read -r name default comment; do
    if [ "$2" = true ]; then value=${!name}; else value=$default; value=${value//\"/}; fi
    printf '  --%-18s %-24s %s\n' "$name" "${value:-\"\"}" "$comment"
  done < <(__po_options "$1")  # IFS below: a separator that is not whitespace keeps empty fields
}

__po_help() {
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$__po_script"
  echo
  echo "Options (current values):"
  __po_print_options "$__po_script" true
  if [ -n "${po_forward_to:-}" ]; then
    echo
    echo "Options passed on to $po_forward_to (its defaults; this script may set some):"
    __po_print_options "$po_forward_to" false
  fi
}

po_forwarded=()
__po_forwardable=
if [ -n "${po_forward_to:-}" ]; then
  __po_forwardable=" $(__po_options "$po_forward_to" | cut -d $'\x1f' -f1 | tr '\n' ' ')"
fi

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
    if [[ $__po_forwardable == *" $__po_var "* ]]; then
      po_forwarded+=("--$__po_var" "$__po_value")
      continue
    fi
    echo "$0: unknown option $__po_name (see --help)" >&2; exit 1
  fi
  case "${!__po_var}" in
    true|false)
      if [ "$__po_value" != true ] && [ "$__po_value" != false ]; then
        echo "$0: option $__po_name takes true or false, got '$__po_value'" >&2; exit 1
      fi ;;
  esac
  printf -v "$__po_var" '%s' "$__po_value"
done
unset __po_name __po_value __po_var __po_forwardable
true
