"""Arbor's inference backend (MLX, no Qt). See docs/ARCHITECTURE.md for the module map."""

from backend.blas import preload_system_blas

preload_system_blas()
