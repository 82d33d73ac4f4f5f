"""Model downloads from the Hugging Face Hub: resumable, with progress, then into the store.

Scope: list a model repo (``huggingface_hub.HfApi.model_info``), pick the files Arbor can load
(a safetensors folder, or one GGUF file), download them with HTTP range requests
(through ``huggingface_hub``'s HTTP session and retry helper) into a staging folder keyed by the repo's commit, verify
sizes and LFS checksums, and import the result with ``ModelStore.import_path``.
Non-scope: Xet transfers and the shared Hugging Face cache (a download here is a staging area
that is deleted once the model is in Arbor's store).

Resume: every file is written to ``<name>.part``. A cancelled, failed or killed download leaves
the part files; the next download of the same repo and commit continues each one from its size
with a ``Range`` request. Files of a commit never change, so this is safe; a part file longer than
the file, or a finished file with the wrong checksum, is discarded.

The endpoint is ``$HF_ENDPOINT`` (default ``https://huggingface.co``), read at call time so tests
can point it at a server on loopback. Errors a user can cause (unknown repo, no loadable weights,
several GGUF files to choose from, no network) raise ``HubError`` with one line.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from backend.errors import ArborError

Progress = Callable[[float, str], None]

DEFAULT_ENDPOINT = "https://huggingface.co"
COMPLETE_MARKER = ".arbor-download-complete"
CHUNK_BYTES = 256 * 1024  # progress and cancellation granularity
DOWNLOAD_TIMEOUT_S = 30.0  # per read: a stalled connection is retried
RETRY_DELAYS_S = (0.2, 1.0, 3.0)  # between attempts after a dropped connection or a busy server
RETRY_STATUS = (429, 500, 502, 503, 504)

#: Top-level files of a safetensors repo that Arbor needs besides the weights.
_SUPPORT_FILES = re.compile(
    r"^(config\.json|generation_config\.json|model\.safetensors\.index\.json|tokenizer\.json|"
    r"tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja|chat_template\.json|"
    r"tokenizer\.model|vocab\.json|merges\.txt|added_tokens\.json)$"
)


class HubError(ArborError):
    """A Hub download cannot proceed (one line naming the repo or file)."""


class DownloadCancelled(HubError):
    """The user cancelled; the part files stay so that the next download resumes."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None
    sha256: str | None = None  # known for LFS files


@dataclass(frozen=True)
class RepoListing:
    repo_id: str
    commit: str
    files: tuple[RemoteFile, ...]


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def list_repo(repo_id: str, revision: str | None = None, token: str | bool | None = None) -> RepoListing:
    """The files (with sizes) of ``repo_id`` at ``revision`` and the commit it resolves to."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    _check_repo_id(repo_id)
    endpoint = hub_endpoint()
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision, files_metadata=True)
    except RepositoryNotFoundError as exc:
        raise HubError(f"{repo_id}: no such model on the Hub (or it is private or gated)") from exc
    except RevisionNotFoundError as exc:
        raise HubError(f"{repo_id}: no revision {revision!r}") from exc
    except HfHubHTTPError as exc:
        raise HubError(f"{repo_id}: the Hub answered {_status(exc)}") from exc
    except OSError as exc:
        raise HubError(f"cannot reach the Hub at {endpoint} ({exc})") from exc
    except Exception as exc:  # httpx2's transport errors do not share a base class with OSError
        if type(exc).__module__.startswith(("httpx", "httpcore")):
            raise HubError(f"cannot reach the Hub at {endpoint} ({exc})") from exc
        raise
    files = tuple(
        RemoteFile(s.rfilename, s.size if s.size is not None else (s.lfs.size if s.lfs else None),
                   s.lfs.sha256 if s.lfs else None)
        for s in (info.siblings or [])
    )
    if not info.sha:
        raise HubError(f"{repo_id}: the Hub did not say which commit {revision or 'main'} is")
    return RepoListing(repo_id, info.sha, files)


def choose_files(listing: RepoListing, filename: str | None = None) -> list[RemoteFile]:
    """The files to fetch: a safetensors model folder's weights and support files, or one GGUF
    file (``filename`` picks it when the repo has several)."""
    by_name = {f.name: f for f in listing.files}
    if filename:
        if filename not in by_name:
            raise HubError(f"{listing.repo_id}: no file {filename!r}")
        if filename.lower().endswith(".gguf"):
            return [by_name[filename]]
    top_level = [f for f in listing.files if "/" not in f.name]
    weights = [f for f in top_level if f.name.endswith(".safetensors")]
    if "config.json" in by_name and weights:
        return sorted((f for f in top_level if f in weights or _SUPPORT_FILES.match(f.name)), key=lambda f: f.name)
    ggufs = sorted(f.name for f in listing.files if f.name.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return [by_name[ggufs[0]]]
    if ggufs:
        raise HubError(f"{listing.repo_id} has {len(ggufs)} GGUF files; choose one: {', '.join(ggufs)}")
    raise HubError(f"{listing.repo_id}: no safetensors weights or GGUF file (PyTorch .bin checkpoints are not supported)")


def staging_folder(root: Path, listing: RepoListing) -> Path:
    return Path(root) / listing.repo_id.replace("/", "--") / listing.commit


def download(
    repo_id: str,
    root: Path,
    *,
    filename: str | None = None,
    revision: str | None = None,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    token: str | bool | None = None,
) -> Path:
    """Download (or resume) a model into ``root``; returns the model folder or the GGUF file.

    ``progress(fraction, message)`` is called as bytes arrive; setting ``cancel`` stops within
    one chunk with ``DownloadCancelled`` (the part files remain for resuming).
    """
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    report = progress or (lambda fraction, message: None)
    listing = list_repo(repo_id, revision, token)
    files = choose_files(listing, filename)
    folder = staging_folder(root, listing)
    folder.mkdir(parents=True, exist_ok=True)
    counter = _ByteCounter(sum(f.size or 0 for f in files) or 1, report, cancel)
    endpoint = hub_endpoint()
    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"  # sizes and ranges count the file's own bytes
    for remote in files:
        target = folder / remote.name
        part = target.with_name(target.name + ".part")
        if target.is_file() and (remote.size is None or target.stat().st_size == remote.size):
            counter.add(target.stat().st_size, f"{remote.name} already downloaded")
            continue
        if part.is_file() and remote.size is not None and part.stat().st_size > remote.size:
            part.unlink()
        url = hf_hub_url(repo_id, remote.name, revision=listing.commit, endpoint=endpoint)
        _fetch(url, part, remote, headers, counter, repo_id)
        if remote.sha256 is not None and _sha256(part) != remote.sha256:
            part.unlink()
            raise HubError(f"{repo_id}: {remote.name} arrived corrupted (checksum mismatch); start again")
        os.replace(part, target)
    (folder / COMPLETE_MARKER).write_text(listing.commit, encoding="utf-8")
    report(1.0, f"downloaded {repo_id}")
    if len(files) == 1 and files[0].name.lower().endswith(".gguf"):
        return folder / files[0].name
    return folder


def _fetch(url: str, part: Path, remote: RemoteFile, headers: dict[str, str], counter: "_ByteCounter",
           repo_id: str) -> None:
    """Append ``url``'s bytes to ``part`` from its current size (a ``Range`` request), retrying
    a dropped connection from where it stopped."""
    import httpx2
    from huggingface_hub.utils import get_session, hf_raise_for_status

    resume = part.stat().st_size if part.is_file() else 0
    counter.add(resume, f"resuming {remote.name}" if resume else f"downloading {remote.name}")
    for attempt in range(len(RETRY_DELAYS_S) + 1):
        resume = part.stat().st_size if part.is_file() else 0
        if remote.size is not None and resume == remote.size:
            return
        request_headers = dict(headers)
        if resume:
            request_headers["Range"] = f"bytes={resume}-"
        try:
            with get_session().stream("GET", url, headers=request_headers, timeout=DOWNLOAD_TIMEOUT_S) as response:
                if response.status_code in RETRY_STATUS and attempt < len(RETRY_DELAYS_S):
                    time.sleep(RETRY_DELAYS_S[attempt])
                    continue
                hf_raise_for_status(response)
                mode = "ab"
                if resume and response.status_code != 206:  # the server ignored the range
                    counter.done -= resume
                    mode = "wb"
                with part.open(mode) as handle:
                    for chunk in response.iter_bytes(CHUNK_BYTES):
                        counter.check_cancelled()
                        handle.write(chunk)
                        counter.add(len(chunk), f"downloading {remote.name}")
        except (httpx2.TransportError, OSError) as exc:
            if attempt == len(RETRY_DELAYS_S):
                raise HubError(f"{repo_id}: downloading {remote.name} failed ({exc}); start again to resume") from exc
            time.sleep(RETRY_DELAYS_S[attempt])
            continue
        except Exception as exc:
            if isinstance(exc, ArborError):
                raise
            raise HubError(f"{repo_id}: downloading {remote.name} failed ({_status(exc)})") from exc
        size = part.stat().st_size
        if remote.size is None or size == remote.size:
            return
        if size > remote.size:
            part.unlink()
            raise HubError(f"{repo_id}: {remote.name} is larger than the Hub says; start again")
    raise HubError(f"{repo_id}: downloading {remote.name} kept stopping early; start again to resume")


def download_to_store(
    repo_id: str,
    store,
    root: Path,
    *,
    name: str | None = None,
    filename: str | None = None,
    quantize: int | None = None,
    revision: str | None = None,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    token: str | bool | None = None,
):
    """``download`` then ``store.import_path`` (``store`` is a ``ModelStore``); the staging
    folder is deleted after a successful import. Download progress is 0-90%, import 90-100%."""
    report = progress or (lambda fraction, message: None)
    source = download(
        repo_id, root, filename=filename, revision=revision, cancel=cancel, token=token,
        progress=lambda f, m: report(0.9 * f, m),
    )
    default_name = Path(source).stem if source.is_file() else repo_id.rsplit("/", 1)[-1]
    stored = store.import_path(source, name=name or _store_name(default_name), quantize=quantize,
                               progress=lambda f, m: report(0.9 + 0.1 * f, m))
    shutil.rmtree(source.parent if source.is_file() else source, ignore_errors=True)
    return stored


# ---------------------------------------------------------------------------------------------
# helpers


def _check_repo_id(repo_id: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo_id or ""):
        raise HubError(f"{repo_id!r} is not a Hub model id (expected owner/name)")


def _store_name(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", stem).lstrip("._+-") or "model"


def _status(exc) -> str:
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return f"HTTP {code}" if code else str(exc).splitlines()[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _ByteCounter:
    """Overall progress across files; raises ``DownloadCancelled`` once ``cancel`` is set."""

    def __init__(self, total: int, report: Progress, cancel: threading.Event | None) -> None:
        self.total = total
        self.done = 0
        self._report = report
        self._cancel = cancel

    def check_cancelled(self) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise DownloadCancelled("download cancelled; start it again to resume")

    def add(self, count: int, message: str) -> None:
        self.check_cancelled()
        self.done += count
        self._report(min(max(self.done, 0) / self.total, 1.0), message)
