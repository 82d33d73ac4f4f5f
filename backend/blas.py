"""Load the system OpenBLAS before ``mlx.core`` so MLX's CPU matmuls use it.

On Linux the ``mlx[cpu]`` wheel links a bundled reference BLAS that is ~30x slower than OpenBLAS
for float32 matrix products. Loading ``libopenblas`` with ``RTLD_GLOBAL`` first makes the dynamic
linker resolve MLX's ``cblas_*`` symbols to it. This must run before anything imports
``mlx.core``; ``backend/__init__.py`` calls it. Set ``ARBOR_BLAS=reference`` to opt out.

A frozen bundle (PyInstaller) carries its own copy, ``libopenblas.so.0`` at the top of the
bundle (``sys._MEIPASS``); that copy is tried first, so the bundle is fast without a system
OpenBLAS.
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

#: The file name of the copy a frozen bundle carries at its top (packaging/arbor.spec).
BUNDLED_NAME = "libopenblas.so.0"

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
    for path in candidates():
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            active_blas = path
            break
    return active_blas


def candidates() -> list[str]:
    """Where OpenBLAS is looked for, in order: the frozen bundle's copy, then the system's."""
    bundled = getattr(sys, "_MEIPASS", None) if getattr(sys, "frozen", False) else None
    return ([os.path.join(bundled, BUNDLED_NAME)] if bundled else []) + list(_CANDIDATES)


def system_openblas() -> str | None:
    """The first system OpenBLAS that exists (what a bundle build copies), or None."""
    return next((path for path in _CANDIDATES if os.path.exists(path)), None)
