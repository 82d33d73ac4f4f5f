"""The disk tier's key (``memory/fingerprint.py``, ``Engine``): a stored state is restored only
into the same weights computed the same way. Real tiny models, a real disk tier."""

from __future__ import annotations

from backend import kernels
from backend.api import DoneEvent, GenerateRequest
from backend.engine import Engine
from backend.memory.budgets import CacheBudgets, CacheConfig
from backend.memory.fingerprint import model_fingerprint
from backend.weights.files import weight_files


def test_the_fingerprint_names_weights_dtype_and_compute_path(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    files = weight_files(folder)
    base = model_fingerprint(folder, files, "float32", "mlx", tmp_path / "hashes.json")
    assert base == model_fingerprint(folder, files, "float32", "mlx", tmp_path / "hashes.json")
    assert base != model_fingerprint(folder, files, "bfloat16", "mlx")
    assert base != model_fingerprint(folder, files, "float32", "kernels-avx2-mid-n2")
    assert (model_fingerprint(folder, files, "float32", "kernels-avx2-mid-n2")
            != model_fingerprint(folder, files, "float32", "kernels-avx512-high-n2"))


def _reused_from_disk(folder, config: CacheConfig, request: GenerateRequest) -> int:
    engine = Engine.load(str(folder), cache=config)
    try:
        done = [e for e in engine.generate(request) if isinstance(e, DoneEvent)][0]
        return done.cached_by_tier["disk"]
    finally:
        engine.close()


def test_states_computed_with_other_kernel_numerics_are_not_restored(
        tiny_model_dir, tmp_path, native_kernels, monkeypatch):
    """A kernel change that moves any bit (``kernels.NUMERICS_VERSION``) starts a new disk
    tier: restoring the old states would give replies a cold start does not."""
    folder = tiny_model_dir("llama")
    on_disk = CacheConfig(CacheBudgets(0, 0, 64 << 20), tmp_path / "cache", capture_interval=16)
    stored = GenerateRequest(prompt_ids=list(range(10, 70)), max_tokens=2, ignore_eos=True)
    resumed = GenerateRequest(prompt_ids=list(range(10, 70)) + [5, 6], max_tokens=2,
                              ignore_eos=True)
    assert _reused_from_disk(folder, on_disk, stored) == 0
    assert _reused_from_disk(folder, on_disk, resumed) > 0  # same numerics: from disk
    monkeypatch.setattr(kernels, "NUMERICS_VERSION", kernels.NUMERICS_VERSION + 1)
    assert _reused_from_disk(folder, on_disk, resumed) == 0


def test_float32_states_stored_from_row_major_weights_are_not_restored_into_panels(
        tiny_model_dir, tmp_path, native_kernels, monkeypatch):
    """Float32 panels move bits (one chain of FMAs per output): states a row-major run stored
    (``ARBOR_PANELS=0``, or an older Arbor) start anew. A quantized model has no panels, and its
    stored states stay valid whatever the setting."""
    from backend.engine import _compute_path
    from backend.weights.loading import load_model

    assert _compute_path(load_model(tiny_model_dir("llama"))).endswith("-panels")
    assert not _compute_path(load_model(tiny_model_dir("qwen3_5-4bit"))).endswith("-panels")
    for kind, restored_after_the_switch in (("llama", False), ("qwen3_5-4bit", True)):
        folder = tiny_model_dir(kind)
        on_disk = CacheConfig(CacheBudgets(0, 0, 64 << 20), tmp_path / kind,
                              capture_interval=16)
        stored = GenerateRequest(prompt_ids=list(range(10, 70)), max_tokens=2, ignore_eos=True)
        resumed = GenerateRequest(prompt_ids=list(range(10, 70)) + [5, 6], max_tokens=2,
                                  ignore_eos=True)
        monkeypatch.setenv("ARBOR_PANELS", "0")
        assert _reused_from_disk(folder, on_disk, stored) == 0
        monkeypatch.delenv("ARBOR_PANELS")
        assert (_reused_from_disk(folder, on_disk, resumed) > 0) == restored_after_the_switch
