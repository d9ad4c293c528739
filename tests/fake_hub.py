"""A stand-in for the Hugging Face hub: a local HTTP server (127.0.0.1, a thread) answering the requests
huggingface_hub 2.x makes for a pull, so that the store's tests never reach the internet.

    GET  /api/models/{owner}/{name}[/revision/{rev}]?blobs=true   model info: sha, siblings (size, lfs)
    HEAD /{owner}/{name}/resolve/{rev}/{path}                     ETag, X-Repo-Commit, X-Linked-Etag/-Size
    GET  /{owner}/{name}/resolve/{rev}/{path}                     the bytes; Range: bytes=N- answers 206

Point huggingface_hub at it with ``HF_ENDPOINT`` (hmad.store.hub reads it at each call). Faults, per file:
``lie_sha`` (the listing states another sha256), ``missing`` (listed, but 404 EntryNotFound on resolve),
``cut_after`` (the first GET sends that many bytes of the body and closes the connection), ``dead``
(every GET sends the headers, then closes the connection).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    lie_sha: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)
    cut_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before the cut (once)
    dead: set[str] = field(default_factory=set)  # paths whose every GET is cut before the body

    def sha(self, path: str) -> str:
        digest = hashlib.sha256(self.files[path]).hexdigest()
        return "0" * 64 if path in self.lie_sha else digest


class FakeHub:
    """``with FakeHub() as hub: hub.repos["owner/name"] = FakeRepo({...})``; ``hub.url`` is the endpoint,
    ``hub.log`` the requests seen as (method, path, Range header)."""

    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.log: list[tuple[str, str, str | None]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def ranges(self, path_end: str) -> list[str | None]:
        """The Range headers of the GETs of files whose URL ends with ``path_end``."""
        return [r for m, p, r in self.log if m == "GET" and p.endswith(path_end)]


_INFO = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/[^/]+)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _serve(self, body: bool) -> None:
            path = self.path.split("?")[0]
            hub.log.append((self.command, path, self.headers.get("Range")))
            if m := _INFO.match(path):
                return self._info(m.group(1))
            if m := _RESOLVE.match(path):
                return self._file(m.group(1), m.group(3), body)
            return self._error(404, "RepoNotFound", "not found")

        def _info(self, repo_id: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", f"Repository Not Found for url: {repo_id}")
            siblings = [
                {
                    "rfilename": p,
                    "size": len(data),
                    "blobId": hashlib.sha1(data).hexdigest(),
                    "lfs": {"size": len(data), "sha256": repo.sha(p), "pointerSize": 134},
                }
                for p, data in repo.files.items()
            ]
            self._send(200, json.dumps({"id": repo_id, "sha": COMMIT, "siblings": siblings}).encode())

        def _file(self, repo_id: str, path: str, body: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository Not Found")
            if path not in repo.files or path in repo.missing:
                return self._error(404, "EntryNotFound", f"Entry Not Found: {path}")
            data, start = repo.files[path], 0
            rng = self.headers.get("Range")
            if rng and (m := re.fullmatch(r"bytes=(\d+)-", rng)):
                start = int(m.group(1))
            headers = {
                "ETag": f'"{repo.sha(path)}"',
                "X-Linked-Etag": f'"{repo.sha(path)}"',
                "X-Linked-Size": str(len(data)),
                "X-Repo-Commit": COMMIT,
                "Accept-Ranges": "bytes",
            }
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            part = data[start:]
            self.send_response(206 if start else 200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            if not body:
                return
            cut = repo.cut_after.pop(path, 0 if path in repo.dead else None)
            if cut is not None:  # a dropped connection: part of the body, then the socket closed
                self.wfile.write(part[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(part)

        def _error(self, code: int, error_code: str, message: str) -> None:
            self._send(code, json.dumps({"error": message}).encode(), {"X-Error-Code": error_code})

        def _send(self, code: int, payload: bytes, extra: dict | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("X-Repo-Commit", COMMIT)
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

    return Handler
