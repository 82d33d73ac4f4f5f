#!/usr/bin/env sh
# Build Arbor's optional native MLX CPU kernels in place (Linux x86-64 only).
# Needs a C++20 compiler and the nanobind package matching MLX (see
# backend/kernels/build.py). Arbor runs without them, on plain MLX.
set -eu
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m backend.kernels.build "$@"
