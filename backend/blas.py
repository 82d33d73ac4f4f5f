"""Load the system OpenBLAS before ``mlx.core`` so MLX's CPU matmuls use it.

On Linux the ``mlx[cpu]`` wheel links a bundled reference BLAS that is ~30x slower than OpenBLAS
for float32 matrix products. Loading ``libopenblas`` with ``RTLD_GLOBAL`` first makes the dynamic
linker resolve MLX's ``cblas_*`` symbols to it. This must run before anything imports
``mlx.core``; ``backend/__init__.py`` calls it. Set ``ARBOR_BLAS=reference`` to opt out.
"""

from __future__ import annotations

import ctypes
import os
import sys

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

#: Which BLAS MLX's CPU backend ended up with: a library path, "bundled", or "accelerate".
active_blas = "bundled"


def preload_system_blas() -> str:
    """Load the system OpenBLAS if present and MLX is not yet imported; return what is active."""
    global active_blas
    if sys.platform == "darwin":
        active_blas = "accelerate"  # MLX uses Apple's Accelerate there
        return active_blas
    if os.environ.get("ARBOR_BLAS") == "reference":
        return active_blas
    if "mlx.core" in sys.modules:  # too late: symbols are already bound
        return active_blas
    for path in _CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            active_blas = path
            break
    return active_blas
