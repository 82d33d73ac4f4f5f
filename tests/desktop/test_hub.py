"""Hub downloads against a fake hub on loopback (never the internet): progress, resume, errors."""

from __future__ import annotations

import threading

import pytest

from backend import hub
from backend.hub import DownloadCancelled, HubError, download, download_to_store
from tests.desktop.fake_hub import FakeHub, FakeHubServer


@pytest.fixture
def fake_hub(monkeypatch):
    with FakeHubServer(FakeHub()) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        yield server


def test_download_to_store_reports_progress_and_imports(fake_hub, tiny_folder, tmp_path):
    from backend.weights.store import ModelStore

    fake_hub.add_folder("arbor-test/tiny-llama", tiny_folder)
    fake_hub.repos["arbor-test/tiny-llama"].files["pytorch_model.bin"] = b"ignored"
    store = ModelStore(tmp_path / "models")
    seen: list[float] = []
    stored = download_to_store("arbor-test/tiny-llama", store, tmp_path / "downloads",
                               progress=lambda f, m: seen.append(f), token=False)
    assert stored.name == "tiny-llama" and stored.architecture == "llama"
    assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) > 3
    assert (stored.path / "model.safetensors").read_bytes() == (tiny_folder / "model.safetensors").read_bytes()
    assert fake_hub.ranges("pytorch_model.bin") == []  # foreign weights are never fetched
    assert fake_hub.ranges("model.safetensors") != []  # (what a fetch looks like)
    assert not list((tmp_path / "downloads").rglob("*.safetensors"))  # staging removed


def test_cancelled_download_resumes_with_a_range_request(fake_hub, tiny_folder, tmp_path):
    fake_hub.add_folder("arbor-test/tiny-llama", tiny_folder)
    cancel = threading.Event()

    def progress(fraction, message):
        if "model.safetensors" in message and fraction > 0.05:
            cancel.set()

    with pytest.raises(DownloadCancelled, match="resume"):
        download("arbor-test/tiny-llama", tmp_path, progress=progress, cancel=cancel, token=False)
    [part] = list(tmp_path.rglob("model.safetensors.part"))
    kept = part.stat().st_size
    assert 0 < kept < (tiny_folder / "model.safetensors").stat().st_size
    folder = download("arbor-test/tiny-llama", tmp_path, token=False)
    assert fake_hub.ranges("model.safetensors")[-1] == f"bytes={kept}-"
    assert (folder / "model.safetensors").read_bytes() == (tiny_folder / "model.safetensors").read_bytes()
    assert not list(tmp_path.rglob("*.part"))


def test_dropped_connection_is_resumed_within_the_download(fake_hub, tmp_path):
    payload = bytes(range(256)) * 4096  # 1 MiB
    fake_hub.add_files("arbor-test/one-gguf", {"model-Q8_0.gguf": payload, "README.md": b"hi"})
    fake_hub.throttle_after = 300_000

    def drop_once(fraction, message):
        if fraction > 0:  # the first response is already being cut short; the retry gets the rest
            fake_hub.throttle_after = None

    path = download("arbor-test/one-gguf", tmp_path, progress=drop_once, token=False)
    assert path.name == "model-Q8_0.gguf" and path.read_bytes() == payload
    ranges = fake_hub.ranges("model-Q8_0.gguf")
    assert ranges[0] is None and len(ranges) == 2
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= 300_000  # what arrived in whole chunks is kept


def test_gguf_repos_with_several_files_need_a_choice(fake_hub, tmp_path):
    fake_hub.add_files("arbor-test/ggufs", {"a-Q4_0.gguf": b"x" * 10, "a-Q8_0.gguf": b"y" * 20})
    with pytest.raises(HubError, match="choose one: a-Q4_0.gguf, a-Q8_0.gguf"):
        download("arbor-test/ggufs", tmp_path, token=False)
    path = download("arbor-test/ggufs", tmp_path, filename="a-Q8_0.gguf", token=False)
    assert path.read_bytes() == b"y" * 20


@pytest.mark.parametrize(
    "repo, files, reason",
    [
        ("arbor-test/missing", None, "no such model on the Hub"),
        ("arbor-test/bins", {"config.json": b"{}", "pytorch_model.bin": b"x"}, "no safetensors weights or GGUF"),
        ("not a repo id", None, "is not a Hub model id"),
    ],
)
def test_user_errors_are_one_line_hub_errors(fake_hub, tmp_path, repo, files, reason):
    if files:
        fake_hub.add_files(repo, files)
    with pytest.raises(HubError, match=reason) as info:
        download(repo, tmp_path, token=False)
    assert "\n" not in str(info.value)


def test_unreachable_hub_is_a_hub_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(HubError, match="cannot reach the Hub"):
        hub.list_repo("arbor-test/anything", token=False)
