"""A Hugging Face cache laid out as huggingface_hub writes it (blobs, snapshots, refs), and a
file-based hub mirror on 127.0.0.1 serving the routes the hub client calls, for the
``pull``/``list``/``rm`` and several-models tests (no network)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from contextlib import contextmanager
from urllib.parse import unquote, urlparse

def commit_of(repo: str) -> str:
    """The repo's commit hash: distinct per repo, as on the hub (the cache's deletion finds
    revisions by hash, so repos sharing one would delete each other's)."""
    return hashlib.sha1(repo.encode()).hexdigest()


def repo_folder(cache: Path, repo: str) -> Path:
    return cache / f"models--{repo.replace('/', '--')}"


def add_to_cache(cache: Path, repo: str, files: dict[str, Path], commit: str | None = None) -> Path:
    """Put ``{path in repo: local file}`` in the cache as the hub client does: content-addressed
    blobs, the snapshot's relative symlinks to them, ``refs/main``. Returns the snapshot dir."""
    folder, commit = repo_folder(cache, repo), commit or commit_of(repo)
    snapshot = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        data = source.read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return snapshot


class Mirror:
    """Repos as ``{repo: {path: local file}}`` served as the hub serves them."""

    def __init__(self, repos: dict[str, dict[str, Path]]):
        self.repos = repos
        self.requests: list[str] = []

    def lookup(self, path: str) -> tuple[str, object] | None:
        parts = [unquote(p) for p in urlparse(path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo, kind = "/".join(parts[2:4]), (parts[4] if len(parts) > 4 else "revision")
            if repo not in self.repos:
                return None
            files = self.repos[repo]
            if kind == "revision":
                siblings = [{"rfilename": n, "size": f.stat().st_size} for n, f in files.items()]
                return "json", {"id": repo, "modelId": repo, "sha": commit_of(repo), "siblings": siblings}
            if kind == "tree":
                return "json", [{"type": "file", "path": n, "size": f.stat().st_size, "oid": _sha1(f)}
                                for n, f in files.items()]
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            if name in self.repos.get(repo, {}):
                return "file", self.repos[repo][name]
        return None


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


@contextmanager
def serve_mirror(mirror: Mirror) -> Iterator[str]:
    """Serve ``mirror`` on 127.0.0.1; yields its endpoint URL; stops on exit."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def answer(self, body: bool) -> None:
            mirror.requests.append(f"{self.command} {self.path}")
            found = mirror.lookup(self.path)
            if found is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            kind, value = found
            data = json.dumps(value).encode() if kind == "json" else value.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "application/json" if kind == "json" else "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            if kind == "file":
                repo = "/".join(unquote(p) for p in urlparse(self.path).path.strip("/").split("/")[:2])
                self.send_header("X-Repo-Commit", commit_of(repo))
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_GET(self) -> None:
            self.answer(True)

        def do_HEAD(self) -> None:
            self.answer(False)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
