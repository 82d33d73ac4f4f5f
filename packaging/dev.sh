#!/usr/bin/env bash
# Set up (or reuse) Arbor's virtual environment, then run the app or the tests.
#
#   bash packaging/dev.sh app [arbor args...]    open Arbor with the embedded default model
#   bash packaging/dev.sh test [pytest args...]  run the test suite
#
# Idempotent: the venv (ARBOR_VENV, default .venv) is created once and dependencies are
# reinstalled only when pyproject.toml changes. On Debian/Ubuntu it installs the system
# OpenBLAS (libopenblas0-pthread), which makes MLX's float32 CPU matmuls ~30x faster.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-app}
shift || true
venv=${ARBOR_VENV:-.venv}

install_openblas() {
  local arch
  arch=$(uname -m)
  [ "$(uname -s)" = Linux ] || return 0
  ls /usr/lib/"$arch"-linux-gnu/libopenblas.so.0 /usr/lib/"$arch"-linux-gnu/openblas-pthread/libopenblas.so.0 \
    >/dev/null 2>&1 && return 0
  command -v apt-get >/dev/null || { echo "note: install OpenBLAS for fast CPU inference" >&2; return 0; }
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  { $sudo apt-get update -qq && $sudo apt-get install -y -qq libopenblas0-pthread; } >/dev/null 2>&1 \
    || echo "note: could not install libopenblas0-pthread; MLX falls back to its slow bundled BLAS" >&2
}

install_python_deps() {
  local extras=$1 stamp="$venv/.arbor-deps-$1"
  local want
  want=$(sha256sum pyproject.toml | cut -c1-16)
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && return 0
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  # The build also fetches the default model's GGUF (packaging/arbor_build.py).
  "$venv/bin/python" -m pip install -q -e ".$extras"
  echo "$want" > "$stamp"
}

build_kernels() {
  # Native CPU kernels (fast decode). The app runs without them; the tests must not: where they
  # can be built (Linux x86-64 with a C++ compiler, tests/skip_policy.py) a failed build stops
  # the test command instead of letting their tests skip.
  "$venv/bin/python" -m backend.kernels.build --quiet && return 0
  if [ "$1" = required ] && "$venv/bin/python" -c \
      'import sys; from tests.skip_policy import kernels_expected; sys.exit(not kernels_expected())'; then
    echo "error: the native CPU kernels did not build on a platform that can build them" >&2
    exit 1
  fi
  echo "note: native CPU kernels not built; using plain MLX matmuls" >&2
}

install_openblas
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
case "$mode" in
  app)
    install_python_deps ""
    build_kernels optional
    exec "$venv/bin/arbor" "$@"
    ;;
  test)
    install_python_deps "[test]"
    build_kernels required
    export QT_QPA_PLATFORM=offscreen
    exec "$venv/bin/python" -m pytest -q "$@"
    ;;
  *)
    echo "usage: bash packaging/dev.sh app|test [args...]" >&2
    exit 2
    ;;
esac
