"""The inference worker's signal contract, with the real tiny model on a real QThread."""

from __future__ import annotations

import pytest

from backend.api import DoneEvent, GenerateRequest, SamplingParams
from desktop.worker import InferenceClient

HELLO = [{"role": "user", "content": "hello"}]


class Recorder:
    """Records (signal name, request id, payload) of every client signal, in order."""

    def __init__(self, client: InferenceClient) -> None:
        self.events: list[tuple[str, int, object]] = []
        for name in ("started", "token", "finished", "cancelled", "errored", "model_loaded", "model_failed"):
            getattr(client, name).connect(lambda rid, *rest, n=name: self.events.append((n, rid, rest[0] if rest else None)))

    def names(self, request_id: int) -> list[str]:
        return [name for name, rid, _ in self.events if rid == request_id]

    def text(self, request_id: int) -> str:
        return "".join(str(p) for name, rid, p in self.events if rid == request_id and name == "token")


@pytest.fixture
def client(qtbot, make_loader):
    clients = []

    def make(delay_s: float = 0.0, updates_per_second: float = 50.0) -> InferenceClient:
        c = InferenceClient(make_loader(delay_s), updates_per_second=updates_per_second)
        clients.append(c)
        with qtbot.waitSignal(c.model_loaded, timeout=20000):
            c.load_model("tiny")
        return c

    yield make
    for c in clients:
        assert c.shutdown(5.0)


def test_one_token_reply_emits_started_token_finished_in_strict_order(qtbot, client):
    c = client()
    with qtbot.waitSignals([c.started, c.token, c.finished], order="strict", timeout=10000):
        c.generate(GenerateRequest(messages=HELLO, max_tokens=1))


def test_stream_order_and_coalesced_text_equals_the_reply(qtbot, client):
    c = client(updates_per_second=20)
    rec = Recorder(c)
    with qtbot.waitSignal(c.finished, timeout=20000) as done:
        rid = c.generate(GenerateRequest(messages=HELLO, max_tokens=120, sampling=SamplingParams(seed=1)))
    names = rec.names(rid)
    assert names[0] == "started" and names[-1] == "finished"
    assert set(names[1:-1]) == {"token"}
    final: DoneEvent = done.args[1]
    assert rec.text(rid) == final.text
    # ~700 tokens/s from the tiny model, at most 20 updates/s: far fewer signals than tokens.
    assert len(names) - 2 < final.generated_tokens
    assert not c.busy


def test_stop_mid_reply_cancels_with_partial_text(qtbot, client):
    c = client(delay_s=0.01)
    rec = Recorder(c)
    rid = c.generate(GenerateRequest(messages=HELLO, max_tokens=400))
    qtbot.waitUntil(lambda: len(rec.text(rid)) > 0, timeout=10000)
    with qtbot.waitSignal(c.cancelled, timeout=5000) as cancelled:
        c.cancel(rid)
    done = cancelled.args[1]
    assert done.finish_reason == "cancelled" and 0 < done.generated_tokens < 400
    assert rec.text(rid) == done.text
    assert rec.names(rid)[-1] == "cancelled"


def test_queued_request_cancelled_before_it_runs_never_starts(qtbot, client):
    c = client(delay_s=0.01)
    rec = Recorder(c)
    first = c.generate(GenerateRequest(messages=HELLO, max_tokens=400))
    second = c.generate(GenerateRequest(messages=HELLO, max_tokens=5))
    c.cancel(second)
    c.cancel(first)
    qtbot.waitUntil(lambda: not c.busy, timeout=10000)
    assert rec.names(second) == ["cancelled"]
    assert rec.events[-1] == ("cancelled", second, None)


def test_tokens_are_tagged_so_requests_never_mix(qtbot, client):
    c = client()
    rec = Recorder(c)
    ids = [c.generate(GenerateRequest(messages=[{"role": "user", "content": f"q{i}"}], max_tokens=30,
                                      sampling=SamplingParams(seed=i))) for i in range(3)]
    qtbot.waitUntil(lambda: not c.busy, timeout=20000)
    finals = {rid: p for name, rid, p in rec.events if name == "finished"}
    for rid in ids:
        assert rec.names(rid)[0] == "started"
        assert rec.text(rid) == finals[rid].text
    starts = [rid for name, rid, _ in rec.events if name == "started"]
    assert starts == ids  # run in the order asked


def test_user_errors_arrive_as_one_line_errored(qtbot, client):
    c = client()
    with qtbot.waitSignal(c.errored, timeout=5000) as err:
        c.generate(GenerateRequest(messages=HELLO, max_tokens=0))
    assert "max_tokens" in err.args[1] and "\n" not in err.args[1]


def test_generate_before_any_model_errors(qtbot, make_loader):
    c = InferenceClient(make_loader())
    rec = Recorder(c)
    try:
        with qtbot.waitSignals([c.started, c.errored], order="strict", timeout=5000):
            rid = c.generate(GenerateRequest(messages=HELLO))
        assert rec.events == [("started", rid, None), ("errored", rid, "no model is loaded")]
    finally:
        assert c.shutdown(5.0)


def test_model_load_failure_is_reported(qtbot, make_loader, tmp_path):
    c = InferenceClient(make_loader())
    try:
        with qtbot.waitSignal(c.model_failed, timeout=10000) as failed:
            c.load_model(str(tmp_path / "missing-model"))
        assert "missing-model" in failed.args[1]
    finally:
        assert c.shutdown(5.0)


def test_shutdown_mid_reply_meets_its_deadline(qtbot, client):
    c = client(delay_s=0.02)
    rec = Recorder(c)
    rid = c.generate(GenerateRequest(messages=HELLO, max_tokens=400))
    qtbot.waitUntil(lambda: "started" in rec.names(rid), timeout=10000)
    assert c.shutdown(2.0)
