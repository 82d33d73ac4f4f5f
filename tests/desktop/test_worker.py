"""The inference worker's signal contract, with the real tiny model on a real QThread."""

from __future__ import annotations

import pytest

from backend.api import DoneEvent, GenerateRequest, SamplingParams
from desktop.app import SHUTDOWN_DEADLINE_S
from desktop.worker import InferenceClient
from tests.desktop.conftest import stream_until

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

    def ended(self, *request_ids: int) -> bool:
        """Each request's last signal (finished, cancelled or errored) has been received. (The
        client stops being ``busy`` one queued event before that signal is delivered.)"""
        return all(self.names(rid)[-1:] in (["finished"], ["cancelled"], ["errored"])
                   for rid in request_ids)


@pytest.fixture
def client(qtbot, make_loader):
    clients = []

    def make(allowance: int | None = None, updates_per_second: float = 50.0) -> InferenceClient:
        """A client with the tiny model loaded; its engine (a ``GatedEngine`` with ``allowance``)
        is ``client.engine``."""
        loader = make_loader(allowance)
        c = InferenceClient(loader, updates_per_second=updates_per_second)
        clients.append(c)
        with qtbot.waitSignal(c.model_loaded, timeout=20000):
            c.load_model("tiny")
        c.engine = loader.engines[-1]
        return c

    yield make
    for c in clients:
        assert c.shutdown(SHUTDOWN_DEADLINE_S)


def test_one_token_reply_emits_started_token_finished_in_strict_order(qtbot, client):
    c = client()
    with qtbot.waitSignals([c.started, c.token, c.finished], order="strict", timeout=10000):
        c.generate(GenerateRequest(messages=HELLO, max_tokens=1))


REQUEST = GenerateRequest(messages=HELLO, max_tokens=60, sampling=SamplingParams(seed=1))


def test_first_token_at_once_then_the_rest_coalesced_within_the_interval(qtbot, client):
    """One update per 1000 s: the first token is sent at once (the next one is still held at
    the gate), everything after it comes as one update when the reply ends."""
    c = client(allowance=1, updates_per_second=0.001)
    rec = Recorder(c)
    rid = c.generate(REQUEST)
    stream_until(qtbot, c.engine, lambda: "token" in rec.names(rid))
    # sent as soon as the first token with text passed, while the next one is held
    first_text = next(i for i, text in enumerate(c.engine.texts) if text)
    assert c.engine.passed == first_text + 1 and c.engine.held()
    with qtbot.waitSignal(c.finished, timeout=20000) as done:
        c.engine.open()
    final: DoneEvent = done.args[1]
    assert sum(1 for text in c.engine.texts if text) > 2  # several tokens had text to merge
    assert rec.names(rid) == ["started", "token", "token", "finished"]
    assert rec.text(rid) == final.text
    assert not c.busy


def test_each_token_is_its_own_update_when_the_interval_allows(qtbot, client):
    c = client(updates_per_second=1e9)
    rec = Recorder(c)
    with qtbot.waitSignal(c.finished, timeout=20000) as done:
        rid = c.generate(REQUEST)
    names = rec.names(rid)
    assert names[0] == "started" and names[-1] == "finished" and set(names[1:-1]) == {"token"}
    tokens = [p for name, r, p in rec.events if r == rid and name == "token"]
    assert tokens == [text for text in c.engine.texts if text]
    assert "".join(tokens) == done.args[1].text


def test_stop_mid_reply_cancels_with_partial_text(qtbot, client):
    c = client(allowance=0)
    rec = Recorder(c)
    rid = c.generate(GenerateRequest(messages=HELLO, max_tokens=400))
    stream_until(qtbot, c.engine, lambda: len(rec.text(rid)) > 0)
    with qtbot.waitSignal(c.cancelled, timeout=20000) as cancelled:
        c.cancel(rid)
    done = cancelled.args[1]
    assert done.finish_reason == "cancelled" and 0 < done.generated_tokens < 400
    assert rec.text(rid) == done.text
    assert rec.names(rid)[-1] == "cancelled"


def test_queued_request_cancelled_before_it_runs_never_starts(qtbot, client):
    c = client(allowance=0)
    rec = Recorder(c)
    first = c.generate(GenerateRequest(messages=HELLO, max_tokens=400))
    second = c.generate(GenerateRequest(messages=HELLO, max_tokens=5))
    qtbot.waitUntil(c.engine.held, timeout=20000)  # the first is running, the second queued
    c.cancel(second)
    c.cancel(first)
    qtbot.waitUntil(lambda: rec.ended(first, second), timeout=20000)
    assert not c.busy
    assert rec.names(first)[0] == "started" and rec.names(first)[-1] == "cancelled"
    assert rec.names(second) == ["cancelled"]
    assert ("cancelled", second, None) in rec.events  # it left the queue without running


def test_tokens_are_tagged_so_requests_never_mix(qtbot, client):
    c = client()
    rec = Recorder(c)
    ids = [c.generate(GenerateRequest(messages=[{"role": "user", "content": f"q{i}"}], max_tokens=30,
                                      sampling=SamplingParams(seed=i))) for i in range(3)]
    qtbot.waitUntil(lambda: rec.ended(*ids), timeout=20000)
    assert not c.busy
    finals = {rid: p for name, rid, p in rec.events if name == "finished"}
    for rid in ids:
        assert rec.names(rid)[0] == "started"
        assert rec.text(rid) == finals[rid].text
    starts = [rid for name, rid, _ in rec.events if name == "started"]
    assert starts == ids  # run in the order asked


def test_user_errors_arrive_as_one_line_errored(qtbot, client):
    c = client()
    with qtbot.waitSignal(c.errored, timeout=20000) as err:
        c.generate(GenerateRequest(messages=HELLO, max_tokens=0))
    assert "max_tokens" in err.args[1] and "\n" not in err.args[1]


def test_generate_before_any_model_errors(qtbot, make_loader):
    c = InferenceClient(make_loader())
    rec = Recorder(c)
    try:
        with qtbot.waitSignals([c.started, c.errored], order="strict", timeout=20000):
            rid = c.generate(GenerateRequest(messages=HELLO))
        assert rec.events == [("started", rid, None), ("errored", rid, "no model is loaded")]
    finally:
        assert c.shutdown(SHUTDOWN_DEADLINE_S)


def test_model_load_failure_is_reported(qtbot, make_loader, tmp_path):
    c = InferenceClient(make_loader())
    try:
        with qtbot.waitSignal(c.model_failed, timeout=10000) as failed:
            c.load_model(str(tmp_path / "missing-model"))
        assert "missing-model" in failed.args[1]
    finally:
        assert c.shutdown(SHUTDOWN_DEADLINE_S)


def test_shutdown_mid_reply_stops_the_reply_within_the_deadline(qtbot, client):
    """Held mid-reply, the generation ends only through the cancellation that shutdown sends."""
    c = client(allowance=3)
    rec = Recorder(c)
    rid = c.generate(GenerateRequest(messages=HELLO, max_tokens=400))
    qtbot.waitUntil(c.engine.held, timeout=20000)
    assert c.shutdown(SHUTDOWN_DEADLINE_S)
    assert not c.engine.waiting  # the held token passed when shutdown cancelled the request
    qtbot.waitUntil(lambda: "cancelled" in rec.names(rid), timeout=20000)  # queued before exit
    [done] = [p for name, r, p in rec.events if r == rid and name == "cancelled"]
    assert done.finish_reason == "cancelled" and done.generated_tokens < 400
