"""Running the server: the loopback rule, the listening socket, uvicorn, an orderly stop.

``ArborServer`` binds its socket when it is made (port 0 picks a free one, ``url`` tells
which), so a bad address is one clear error before anything else runs and clients can connect
at once (they wait in the backlog until uvicorn accepts). ``run()`` serves until a signal or
``stop()``; stopping cancels every generation first so open streams end promptly, and the
engine thread closes the engine (pending cache states are written to disk).
"""

from __future__ import annotations

import ipaddress
import signal
import socket
from typing import Callable

import uvicorn

from backend.errors import ArborError
from backend.server.app import MAX_BODY_BYTES, create_app
from backend.server.engine_thread import EngineThread, ServedEngine


class ServeError(ArborError):
    """The server cannot start as asked (address, key); one line for the CLI."""


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_exposure(host: str, api_key: str | None) -> None:
    """A server reachable from other machines must ask for a key."""
    if not api_key and not is_loopback(host):
        raise ServeError(f"--host {host} is not a loopback address: other machines could use "
                         "this server; give --api-key KEY (or set ARBOR_API_KEY) to serve "
                         "there, or use --host 127.0.0.1")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (ServeError with the reason when it cannot)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, socket.gaierror) as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def fast_transport() -> dict:
    """uvicorn's C HTTP parser (httptools) and event loop (uvloop), both dependencies, named
    as classes and modules so a frozen bundle carries them: with 8 replies streaming, the
    pure-Python parser and loop take CPU time the model's steps need (``arbor bench batch``:
    8 clients 117 -> 123 tokens/s, medians of 4 alternating runs). Where one is missing (a
    platform without a uvloop wheel) the server runs on h11 or asyncio instead."""
    options: dict = {"http": "h11", "loop": "asyncio"}
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        options["http"] = HttpToolsProtocol
    except ImportError:
        pass
    try:
        import uvicorn.loops.uvloop  # noqa: F401  (what "uvloop" names; imports uvloop)
        options["loop"] = "uvloop"
    except ImportError:
        pass
    return options


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        """Ctrl-C / SIGTERM: cancel the generations, then stop as uvicorn does (a second
        Ctrl-C stops waiting for open connections). Unlike uvicorn the signal is not raised
        again after the server stopped: ``serve`` still has to close the engine, and then
        returns normally."""
        self._on_exit()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


class ArborServer:
    """An OpenAI-compatible server over ``engine`` (a started ``EngineThread``) on ``sock``
    (from ``bind``; the server closes it)."""

    def __init__(self, engine: EngineThread, sock: socket.socket, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, log_level: str = "info") -> None:
        self.engine = engine
        self.socket = sock
        host, port = sock.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        app = create_app(engine, api_key=api_key, max_body_bytes=max_body_bytes)
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10,
                                **fast_transport())
        self._server = _Uvicorn(config, on_exit=engine.cancel_all)

    def run(self) -> None:
        """Serve until ``stop()`` or a signal (signals only on the main thread)."""
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self.socket.close()

    def stop(self) -> None:
        self.engine.cancel_all()
        self._server.should_exit = True


def serve(load: Callable[[], ServedEngine], host: str, port: int, api_key: str | None,
          announce: Callable[[str], None] = print) -> int:
    """``arbor serve``: check the address and bind it, load the model on the engine thread,
    serve until Ctrl-C / SIGTERM."""
    check_exposure(host, api_key)  # before the model loads: refusals are immediate
    sock = bind(host, port)
    engine = EngineThread(load)
    try:
        info = engine.start()
        server = ArborServer(engine, sock, api_key)
        announce(f"arbor serve: {info.name} at {server.url}/v1"
                 + (" (API key required)" if api_key else ""))
        server.run()
    finally:
        sock.close()
        if not engine.close():
            announce("arbor serve: the engine was still busy at exit")
    return 0
