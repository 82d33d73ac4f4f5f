"""A tiny Hugging Face Hub on loopback, enough for ``huggingface_hub`` downloads.

Serves ``GET /api/models/<repo>[/revision/<rev>]`` (the repo's files with sizes and LFS sha256)
and ``GET|HEAD /<repo>/resolve/<rev>/<file>`` with ``Range`` support, the ``X-Repo-Commit`` and
``ETag`` headers the client checks. Every request is recorded (path and ``Range``) so tests can
see resumes happen. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str = COMMIT


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    url: str = ""
    #: while set, resolve responses stop after this many bytes of the body (a dropped connection)
    throttle_after: int | None = None

    def add_folder(self, repo_id: str, folder: Path) -> None:
        files = {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
        self.repos[repo_id] = FakeRepo(files)

    def add_files(self, repo_id: str, files: dict[str, bytes]) -> None:
        self.repos[repo_id] = FakeRepo(dict(files))

    def ranges(self, suffix: str) -> list[str | None]:
        return [rng for method, path, rng in self.requests if method == "GET" and path.endswith(suffix)]


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(head=True)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(head=False)

        def _serve(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if api:
                return self._model_info(api.group(1))
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if resolve:
                return self._resolve(resolve.group(1), resolve.group(3), head)
            self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"})

        def _model_info(self, repo_id: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                body = json.dumps({"error": "Repository not found"}).encode()
                return self._send(404, body, {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})
            siblings = []
            for name, data in repo.files.items():
                entry = {"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest()}
                if name.endswith((".safetensors", ".gguf")):
                    entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 130}
                siblings.append(entry)
            body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "siblings": siblings}).encode()
            self._send(200, body, {"Content-Type": "application/json"})

        def _resolve(self, repo_id: str, name: str, head: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None or name not in repo.files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
            data = repo.files[name]
            headers = {
                "X-Repo-Commit": repo.commit,
                "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            status, start = 200, 0
            requested = self.headers.get("Range")
            if requested:
                match = re.fullmatch(r"bytes=(\d+)-", requested)
                start = int(match.group(1)) if match else 0
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            if head:
                return self._send(status, b"", {**headers, "Content-Length": str(len(body))}, body_length=len(body))
            limit = hub.throttle_after
            if limit is not None and len(body) > limit:
                # Promise the whole body, send part of it, then close: a dropped connection.
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body[:limit])
                self.wfile.flush()
                self.close_connection = True
                return
            self._send(status, body, headers)

        def _send(self, status: int, body: bytes, headers: dict[str, str], body_length: int | None = None) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(body) if body_length is None else body_length))
            self.end_headers()
            if body:
                self.wfile.write(body)

    return Handler


class FakeHubServer:
    """Context manager: starts the fake hub on 127.0.0.1 (random port) in a thread."""

    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
        self._server.daemon_threads = True
        hub.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self.hub

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
