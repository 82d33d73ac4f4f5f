#!/usr/bin/env bash
# Set up (or reuse) Arbor's virtual environment, then run the app or the tests.
#
#   bash packaging/dev.sh app [arbor args...]    open Arbor with the embedded default model
#   bash packaging/dev.sh test [pytest args...]  run the test suite
#   bash packaging/dev.sh bundle [--force]       build the double-clickable bundle (dist/Arbor/)
#
# Idempotent: the venv (ARBOR_VENV, default .venv; for `bundle` a separate build venv,
# ARBOR_BUNDLE_VENV, default .venv-bundle, with the runtime dependencies and PyInstaller only)
# is created once and dependencies are reinstalled only when pyproject.toml changes. On
# Debian/Ubuntu it installs the system OpenBLAS (libopenblas0-pthread), which makes MLX's
# float32 CPU matmuls ~30x faster (and which the bundle carries).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-app}
shift || true
venv=${ARBOR_VENV:-.venv}
[ "$mode" = bundle ] && venv=${ARBOR_BUNDLE_VENV:-.venv-bundle}

apt_install() {  # apt_install PACKAGE...: true if they got installed
  command -v apt-get >/dev/null || return 1
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  { $sudo apt-get update -qq && $sudo apt-get install -y -qq "$@"; } >/dev/null 2>&1
}

install_openblas() {
  local arch
  arch=$(uname -m)
  [ "$(uname -s)" = Linux ] || return 0
  ls /usr/lib/"$arch"-linux-gnu/libopenblas.so.0 /usr/lib/"$arch"-linux-gnu/openblas-pthread/libopenblas.so.0 \
    >/dev/null 2>&1 && return 0
  command -v apt-get >/dev/null || { echo "note: install OpenBLAS for fast CPU inference" >&2; return 0; }
  apt_install libopenblas0-pthread \
    || echo "note: could not install libopenblas0-pthread; MLX falls back to its slow bundled BLAS" >&2
}

install_build_tools() {
  # What a fresh Debian/Ubuntu machine lacks to make the bundle from a clean clone: venv for the
  # build venv, a C++ compiler and Python's headers for the native kernels.
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || apt_install python3-venv \
    || echo "note: could not install python3-venv" >&2
  command -v c++ >/dev/null || command -v g++ >/dev/null || apt_install g++ \
    || echo "note: could not install g++; the bundle needs it for the native kernels" >&2
  python3 -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || apt_install python3-dev || echo "note: could not install python3-dev" >&2
}

install_qt_xcb_libs() {
  # Qt's X11 platform plugin needs these; the bundle carries the ones found at build time, so a
  # desktop without them (Qt 6 wants libxcb-cursor0, which many lack) still opens the window.
  [ "$(uname -s)" = Linux ] && command -v dpkg-query >/dev/null || return 0
  local missing="" pkg
  for pkg in libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-image0 libxcb-render-util0 \
      libxcb-randr0 libxcb-shape0 libxcb-xkb1 libxkbcommon-x11-0; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing="$missing $pkg"
  done
  [ -z "$missing" ] && return 0
  # shellcheck disable=SC2086 # one word per package
  apt_install $missing || echo "note: could not install$missing; the bundle needs them on the user's machine" >&2
}

install_libpython() {
  # PyInstaller bundles the interpreter's shared library; Debian/Ubuntu ship it on its own.
  local check='import sys; from PyInstaller.depend.bindepend import get_python_library_path as f
sys.exit(f() is None)'
  "$venv/bin/python" -c "$check" >/dev/null 2>&1 && return 0
  apt_install "libpython$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
    || echo "note: no shared Python library found; PyInstaller will say what it needs" >&2
}

install_python_deps() {
  local extras=$1 stamp="$venv/.arbor-deps-$1"
  local want
  want=$({ cat pyproject.toml packaging/test-references.txt | sha256sum 2>/dev/null \
           || cat pyproject.toml packaging/test-references.txt | shasum -a 256; } | cut -c1-16)
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && return 0
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  # The build also fetches the default model's GGUF (packaging/arbor_build.py).
  "$venv/bin/python" -m pip install -q -e ".$extras"
  if [ "$extras" = "[test]" ]; then
    # The drafters' reference implementations, without their own dependencies (see the file).
    "$venv/bin/python" -m pip install -q --no-deps -r packaging/test-references.txt
  fi
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
if [ ! -x "$venv/bin/python" ]; then
  [ "$mode" = bundle ] && [ "$(uname -s)" = Linux ] && install_build_tools  # first set-up only
  python3 -m venv "$venv"
fi
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
  bundle)
    install_python_deps "[bundle]"
    install_libpython
    install_qt_xcb_libs
    # build_bundle.py builds the kernels into the bundle (and stops if they cannot be built).
    exec "$venv/bin/python" packaging/build_bundle.py "$@"
    ;;
  *)
    echo "usage: bash packaging/dev.sh app|test|bundle [args...]" >&2
    exit 2
    ;;
esac
