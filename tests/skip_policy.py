"""The suite tells the truth: nothing skips silently.

Two rules, applied to every test report (``tests/conftest.py`` installs the hooks):

1. A skip (or xfail) must name a platform that is absent here: its reason starts with one of
   the phrases below (``macOS only``, ``not Linux x86-64``, ``no C++ compiler``,
   ``not root on Linux``) and that
   platform really is absent on this machine. Anything else - a file setup should have
   provided, a build that failed, a package that is missing - turns the skip into a failure.
2. The parts that setup provides must run where they are expected: a test that uses one of
   ``PARTS``'s fixtures (the native kernels on Linux x86-64 with a compiler, the default model,
   the real-vocabulary tokenizers) fails when it is skipped there, whatever the reason.

Both rules look only at the tests that were selected: ``pytest tests/test_sampling.py`` or
``-k`` never collects the kernel tests, so nothing fires for them; a kernel test that was
collected and then skipped on a machine that can build the kernels fails the run.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import pytest

MACOS_ONLY = "macOS only"
NOT_LINUX_X86_64 = "not Linux x86-64"
NO_COMPILER = "no C++ compiler"
NOT_ROOT_ON_LINUX = "not root on Linux"  # mounting a tmpfs (disk-full and read-only mounts)


def linux_x86_64() -> bool:
    return sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")


def compiler_found() -> bool:
    """The compiler the kernel build would use (``CXX``, ``c++``, ``g++``, ``clang++``)."""
    from backend.kernels.build import BuildError, _find_compiler

    try:
        _find_compiler()
    except BuildError:
        return False
    return True


def root_on_linux() -> bool:
    import os

    return sys.platform == "linux" and os.geteuid() == 0


def kernels_expected() -> bool:
    """Where the native kernels must build and their tests run (``packaging/dev.sh test`` stops
    when they do not build here)."""
    return linux_x86_64() and compiler_found()


def absent_platforms() -> list[str]:
    """The phrases a skip reason may start with on this machine."""
    checks: dict[str, Callable[[], bool]] = {
        MACOS_ONLY: lambda: sys.platform != "darwin",
        NOT_LINUX_X86_64: lambda: not linux_x86_64(),
        NO_COMPILER: lambda: not compiler_found(),
        NOT_ROOT_ON_LINUX: lambda: not root_on_linux(),
    }
    return [phrase for phrase, absent in checks.items() if absent()]


def platform_skip(phrase: str, detail: str) -> NoReturn:
    """Skip because ``phrase`` (one of the constants above) holds here."""
    pytest.skip(f"{phrase}: {detail}")


@dataclass(frozen=True)
class Part:
    """Something setup provides, and the fixture through which tests use it."""

    fixture: str
    description: str
    expected: Callable[[], bool]


PARTS = (
    Part("native_kernels", "the native CPU kernels", kernels_expected),
    Part("default_model_gguf", "the default model (SmolLM2-135M-Instruct)", lambda: True),
    Part("smollm2", "the real-vocabulary (SmolLM2) tokenizer", lambda: True),
)


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The reason of a skipped or xfailed report; None when it was not skipped."""
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}" if report.wasxfail else "xfail"
    if not report.skipped:
        return None
    longrepr = report.longrepr
    message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return message.removeprefix("Skipped: ")


def judge(reason: str, fixtures: tuple[str, ...] | list[str]) -> str | None:
    """Why a skip with ``reason`` of a test using ``fixtures`` is not acceptable (None: it is)."""
    for part in PARTS:
        if part.fixture in fixtures and part.expected():
            return (f"{part.description} should run on this machine, but the test was skipped: "
                    f"{reason}")
    if not any(reason.startswith(phrase) for phrase in absent_platforms()):
        return f"a skip must name a platform absent here, not: {reason}"
    return None


def _fail(report: pytest.TestReport | pytest.CollectReport, problem: str) -> None:
    report.outcome = "failed"
    report.longrepr = f"skip policy (tests/skip_policy.py): {problem}"
    if hasattr(report, "wasxfail"):
        del report.wasxfail


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    reason = skip_reason(report)
    if reason is not None:
        problem = judge(reason, getattr(item, "fixturenames", ()))
        if problem:
            _fail(report, problem)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    reason = skip_reason(report)
    if reason is not None:
        problem = judge(reason, ())
        if problem:
            _fail(report, problem)
    return report
