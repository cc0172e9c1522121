#!/usr/bin/env bash
# Idempotent installer: system packages (espeak-ng, sox; with --dev also Slurm) and a
# Python virtual environment holding the pinned requirements.
#
# Usage: bash tools/install.sh          # runtime requirements
#        bash tools/install.sh --dev    # plus test, lint and benchmark tools (and kenlm's
#                                       # build_binary and lmplz, tools/build_kenlm_binary.sh)
#
# Re-running is cheap: the virtual environment is reused, and pip only runs
# again when a requirements file changed since the last successful install.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$root/tools/venv
python=${PYTHON:-python3}
dev=false
[ "${1:-}" = "--dev" ] && dev=true

log() { echo "$(date '+%Y-%m-%d %H:%M:%S') (install.sh:${BASH_LINENO[0]}) $*" >&2; }

# --- system packages --------------------------------------------------------
# espeak-ng speaks the synthetic corpus; sox converts its audio; g++ and make build the
# kenlm Python module, which PyPI has only as source; libopus0 decodes Opus shards directly
# (cat.audio.codec; without it they go through libsndfile, more slowly).
apt_packages=(espeak-ng sox g++ make libopus0)
# Boost builds kenlm's lmplz (tools/build_kenlm_binary.sh lmplz), which the tests check.
$dev && apt_packages+=(libboost-program-options-dev libboost-thread-dev libboost-system-dev)
# The tests of Slurm array jobs run a private one-node cluster (cat/testing/slurm.py:
# munged, slurmctld and slurmd on free 127.0.0.1 ports, with their own key, socket and
# configuration). The services these packages install do not get in its way: Debian's
# slurmctld and slurmd start only once /etc/slurm/slurm.conf exists, which no package
# ships, and a system munged keeps to its own key and socket.
$dev && apt_packages+=(slurmctld slurmd slurm-client munge)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
# Wait for another package manager (say, unattended upgrades on a fresh machine) to finish
# instead of failing: apt-get waits for the dpkg lock itself, but `update` gives up at once
# on the package lists' lock, so it is tried again.
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "$@" >/dev/null
}
apt_update() {
  local try
  for try in 1 2 3 4 5 6 7 8 9 10; do
    apt-get -o DPkg::Lock::Timeout=600 update -qq && return 0
    log "apt-get update failed (try $try of 10); trying again in 30 s"
    sleep 30
  done
  return 1
}
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    log "installing Debian packages: ${missing[*]}"
    # Refresh the package lists only when the cache is empty (a fresh machine).
    if ! compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null; then
      apt_update
    fi
    apt_install "${missing[@]}" || { apt_update && apt_install "${missing[@]}"; }
  else
    echo "ERROR: missing system packages: ${missing[*]}." >&2
    echo "Install them as root, e.g.: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi
# The server's page is tested in headless Chromium (with a CJK font for its screenshot).
# Where it cannot be installed that test skips, saying why; nothing else needs it.
if $dev; then
  browser=()
  for pkg in chromium fonts-wqy-microhei; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || browser+=("$pkg")
  done
  if [ ${#browser[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
      log "installing Debian packages for the browser test: ${browser[*]}"
      apt_install "${browser[@]}" || { apt_update && apt_install "${browser[@]}"; } \
        || log "WARNING: could not install ${browser[*]}; the browser test will skip"
    else
      log "WARNING: ${browser[*]} not installed (not root); the browser test will skip"
    fi
  fi
fi

# --- python environment -----------------------------------------------------
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "ERROR: $python is older than Python 3.10" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  log "creating virtual environment $venv"
  "$python" -m venv "$venv"
fi

req=$root/requirements.txt
$dev && req=$root/requirements-dev.txt
stamp=$root/tools/.installed-$(basename "$req" .txt)
want=$(cat "$root/requirements.txt" "$req" | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "installing Python requirements from $(basename "$req")"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
  echo "$want" > "$stamp.tmp" && mv "$stamp.tmp" "$stamp"
fi
# The tests check kenlm binaries against their ARPA and lmplz's models against
# cat.lm.ngram's, so the test set-up builds kenlm's build_binary and lmplz (once, about
# 2 minutes on 2 cores; the recipes build lmplz on demand for lm.json "estimator": "lmplz").
if $dev; then
  bash "$root/tools/build_kenlm_binary.sh" build_binary lmplz
  # ESPnet, the peer of bench/peer_update.py, goes beside the environment (into it, pip
  # would downgrade pinned packages); the script knows its pins and skips a done install.
  "$venv/bin/python" "$root/bench/peer_update.py" --install
fi
log "environment ready: $venv"
