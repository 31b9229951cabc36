"""A stand-in for the Hugging Face Hub on loopback: local folders served as repositories over the endpoints
huggingface_hub calls (repository info with file metadata, and ``resolve`` with HEAD and ranged GET), with
every request recorded with the body bytes it was sent. Select it with ``HF_ENDPOINT``; no test reaches the
internet."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".model")


@dataclass
class StandinRepo:
    commits: dict[str, Path]
    """Commit sha -> the folder served as the repository at that commit."""
    refs: dict[str, str]
    """Branch or tag -> commit sha."""
    gated: bool = False


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    nbytes: int = 0
    """Body bytes sent in answer (those the client may not have read included)."""


@dataclass
class StandinHub:
    repos: dict[str, StandinRepo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    url: str = ""
    ignore_range: bool = False
    """Answer every GET with the whole file, as a server that does not serve ranges does."""

    def add_repo(self, repo_id: str, folder: Path, *, branch: str = "main", gated: bool = False) -> str:
        """Serve `folder` as `repo_id` at `branch`; returns the commit sha it gets."""
        commit = hashlib.sha1(f"{repo_id}:{branch}:{folder}".encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, StandinRepo({}, {}, gated))
        repo.commits[commit] = folder
        repo.refs[branch] = commit
        repo.gated = gated
        return commit

    def weight_requests(self) -> list[Request]:
        """Requests that read a weight file's bytes (a GET of a weight file)."""
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path and r.path.endswith(LFS_SUFFIXES)]

    def downloaded(self) -> list[str]:
        """Files fetched whole (GETs without a Range), as repository paths."""
        return [r.path.split("/resolve/", 1)[1].split("/", 1)[1] for r in self.requests if r.method == "GET" and "/resolve/" in r.path and r.range is None]


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: StandinHub

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._serve(body=True)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self._request = Request(self.command, path, self.headers.get("Range"))
        self.hub.requests.append(self._request)
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if info:
            repo_id, revision = info[1], info[2] or "main"
        elif resolve:
            repo_id, revision = resolve[1], resolve[2]
        else:
            return self._error(404, "EntryNotFound", "no such endpoint")
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(401, "RepoNotFound", "Repository not found")  # the Hub's answer to an unknown repo
        if repo.gated and "authorization" not in {k.lower() for k in self.headers}:
            return self._error(401, "GatedRepo", "Access to this repository is restricted")
        commit = repo.refs.get(revision, revision if revision in repo.commits else None)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        folder = repo.commits[commit]
        if info:
            return self._info(repo_id, commit, folder, body)
        return self._file(commit, folder / resolve[3], body)

    def _info(self, repo_id: str, commit: str, folder: Path, body: bool) -> None:
        siblings = []
        for p in _files(folder):
            data = p.read_bytes()
            entry = {"rfilename": p.relative_to(folder).as_posix(), "size": len(data), "blobId": _blob_id(data)}
            if p.name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        payload = json.dumps({"id": repo_id, "modelId": repo_id, "sha": commit, "siblings": siblings, "private": False}).encode()
        self._send(200, payload, {"Content-Type": "application/json"}, body)

    def _file(self, commit: str, file: Path, body: bool) -> None:
        if not file.is_file():
            return self._error(404, "EntryNotFound", f"{file.name} does not exist")
        data = file.read_bytes()
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if file.name.endswith(LFS_SUFFIXES):
            headers.update({"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data)),
                            "ETag": f'"{hashlib.sha256(data).hexdigest()}"'})  # fmt: skip
        else:
            headers["ETag"] = f'"{_blob_id(data)}"'
        wanted = self.headers.get("Range")
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted or "")
        if match and not self.hub.ignore_range:
            start = int(match[1])
            end = min(int(match[2]) if match[2] else len(data) - 1, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._send(206, data[start : end + 1], headers, body)
        self._send(200, data, headers, body)

    def _error(self, status: int, code: str, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        self._send(status, payload, {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}, True)

    def _send(self, status: int, payload: bytes, headers: dict[str, str], body: bool) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body and self.command != "HEAD":
            self._request.nbytes = len(payload)
            try:
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):  # a client that stopped reading (a range not served)
                self.close_connection = True


def select_standin_hub(hub: StandinHub, monkeypatch, tmp_path: Path, *, fresh: bool = True) -> StandinHub:
    """Point huggingface_hub at `hub` for one test, with an empty cache of the test's own, online (the suite is
    offline otherwise) and without a token. `fresh`: the hub starts with no repository, no request and ranges
    served, and the test runs in `tmp_path` ("test-org/..." is certainly not a relative path there)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    if fresh:
        monkeypatch.chdir(tmp_path)
        hub.repos.clear()
        hub.requests.clear()
        hub.ignore_range = False
    return hub


def start_standin_hub() -> tuple[StandinHub, ThreadingHTTPServer]:
    """A running stand-in Hub on loopback (stop it with ``server.shutdown()``)."""
    hub = StandinHub()
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return hub, server


@contextlib.contextmanager
def serving_standin_hub() -> Iterator[StandinHub]:
    """A stand-in Hub on loopback for the block, stopped at its end."""
    hub, server = start_standin_hub()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
