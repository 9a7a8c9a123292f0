"""A Hugging Face hub on 127.0.0.1 for tests: the endpoints huggingface_hub's
``snapshot_download`` / ``hf_hub_download`` call (read from its source, version 2.x), served by
aiohttp on an ephemeral port in a background thread. Point a process at it with
``HF_ENDPOINT=hub.url``.

* ``GET /api/models/{org}/{name}[/revision/{rev}]`` - model info; ``sha`` is the commit the
  revision resolves to (HfApi.model_info / repo_info);
* ``GET /api/models/{org}/{name}/tree/{rev}?recursive=...`` - the file listing with sizes, git
  blob ids and LFS sha256s (HfApi.list_repo_tree);
* ``HEAD`` / ``GET /{org}/{name}/resolve/{rev}/{path}`` - a file, with the headers
  ``get_hf_file_metadata`` needs: ``X-Repo-Commit``, ``ETag`` (the LFS sha256, or the git blob
  sha1), ``X-Linked-Etag`` / ``X-Linked-Size`` for LFS files, ``Content-Length``, and ``Range``
  requests answered 206 (how ``http_get`` resumes a dropped transfer).

Errors carry the ``X-Error-Code`` header ``hf_raise_for_status`` maps to exception types:
``RepoNotFound`` (404), ``RevisionNotFound`` (404), ``EntryNotFound`` (404), ``GatedRepo``
(401 without a token, 403 with a wrong one; a gated repo's info and listing stay public, as on
the real hub). Every request is recorded (:attr:`LocalHub.requests`); ``drop_once[(repo, path)]
= n`` makes the next GET of that file send n bytes and drop the connection. (huggingface_hub
reads 10 MiB chunks and resumes from the last whole chunk on disk, so a resume with a Range
request needs more than 10 MiB received before the drop.)
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

LFS_MIN_BYTES = 10_000  # files this big are served as LFS objects, as the hub does for weights


def blob_sha1(data: bytes) -> str:
    """The git blob id of ``data`` (what the hub lists as ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch / tag -> sha
    gated_token: str | None = None  # set: files need "Authorization: Bearer <token>"

    def add_commit(self, files: dict[str, bytes], *refs: str) -> str:
        digest = hashlib.sha1(repr(sorted((p, hashlib.sha256(d).hexdigest()) for p, d in files.items())).encode())
        sha = digest.hexdigest()
        self.commits[sha] = dict(files)
        for ref in refs or ("main",):
            self.refs[ref] = sha
        return sha

    def commit(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None


def read_dir(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by its POSIX relative path."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


class LocalHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[dict] = []
        self.drop_once: dict[tuple[str, str], int] = {}  # (repo_id, path) -> bytes sent before the drop
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ------------------------------------------------------------------ content

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, gated_token: str | None = None) -> Repo:
        repo = Repo(repo_id, gated_token=gated_token)
        repo.add_commit(files, "main")
        self.repos[repo_id] = repo
        return repo

    def files_fetched(self, repo_id: str) -> set[str]:
        """Paths whose content was sent (GET answered 200 or 206)."""
        return {r["path"] for r in self.log(repo_id)
                if r["kind"] == "file" and r["method"] == "GET" and r["status"] in (200, 206)}

    def log(self, repo_id: str | None = None) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self.requests if repo_id is None or r.get("repo") == repo_id]

    # ------------------------------------------------------------------ server

    def start(self) -> "LocalHub":
        ready = threading.Event()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name="local-hub", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the local hub did not start")
        return self

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}", self._info)
        app.router.add_get("/api/models/{org}/{name}/revision/{revision}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{revision}", self._tree)
        app.router.add_route("HEAD", "/{org}/{name}/resolve/{revision}/{path:.+}", self._file)
        app.router.add_get("/{org}/{name}/resolve/{revision}/{path:.+}", self._file, allow_head=False)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        if self._loop is None:
            return
        loop = self._loop
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> "LocalHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ handlers

    def _record(self, request: web.Request, repo_id: str, status: int, path: str = "", kind: str = "") -> None:
        with self._lock:
            self.requests.append({"method": request.method, "repo": repo_id, "path": path, "kind": kind,
                                  "status": status, "range": request.headers.get("Range"),
                                  "authorization": request.headers.get("Authorization")})

    @staticmethod
    def _error(status: int, code: str, message: str, **headers: str) -> web.Response:
        return web.json_response({"error": message}, status=status,
                                 headers={"X-Error-Code": code, "X-Error-Message": message, **headers})

    def _repo(self, request: web.Request) -> tuple[str, Repo | None]:
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        return repo_id, self.repos.get(repo_id)

    async def _info(self, request: web.Request) -> web.Response:
        repo_id, repo = self._repo(request)
        revision = request.match_info.get("revision", "main")
        if repo is None:
            self._record(request, repo_id, 404, kind="info")
            return self._error(404, "RepoNotFound", "Repository not found")
        sha = repo.commit(revision)
        if sha is None:
            self._record(request, repo_id, 404, kind="info")
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        self._record(request, repo_id, 200, kind="info")
        return web.json_response({
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
            "author": repo_id.split("/")[0], "sha": sha, "private": False,
            "gated": "manual" if repo.gated_token else False, "disabled": False, "tags": [],
            "lastModified": "2025-01-01T00:00:00.000Z", "createdAt": "2025-01-01T00:00:00.000Z",
            "siblings": [{"rfilename": p} for p in sorted(repo.commits[sha])],
        })

    async def _tree(self, request: web.Request) -> web.Response:
        repo_id, repo = self._repo(request)
        sha = repo.commit(request.match_info["revision"]) if repo else None
        if sha is None:
            self._record(request, repo_id, 404, kind="tree")
            return self._error(404, "RepoNotFound" if repo is None else "RevisionNotFound", "not found")
        files = repo.commits[sha]
        entries, folders = [], set()
        for path, data in sorted(files.items()):
            parts = path.split("/")
            folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
            entry = {"type": "file", "oid": blob_sha1(data), "size": len(data), "path": path}
            if len(data) >= LFS_MIN_BYTES:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        entries += [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                    for f in sorted(folders)]
        self._record(request, repo_id, 200, kind="tree")
        return web.json_response(entries)

    async def _file(self, request: web.Request) -> web.StreamResponse:
        repo_id, repo = self._repo(request)
        path = request.match_info["path"]
        if repo is None:
            self._record(request, repo_id, 404, path, "file")
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.gated_token and request.headers.get("Authorization") != f"Bearer {repo.gated_token}":
            status = 403 if request.headers.get("Authorization") else 401
            self._record(request, repo_id, status, path, "file")
            return self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                                                     "access to it and be authenticated to access it. Please log in.")
        sha = repo.commit(request.match_info["revision"])
        if sha is None:
            self._record(request, repo_id, 404, path, "file")
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        data = repo.commits[sha].get(path)
        if data is None:
            self._record(request, repo_id, 404, path, "file")
            return self._error(404, "EntryNotFound", f"{path} does not exist", **{"X-Repo-Commit": sha})
        lfs = len(data) >= LFS_MIN_BYTES
        etag = hashlib.sha256(data).hexdigest() if lfs else blob_sha1(data)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if lfs:
            headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
        start, status = 0, 200
        range_header = request.headers.get("Range")
        if range_header and range_header.startswith("bytes=") and request.method == "GET":
            first, _, last = range_header[6:].partition("-")
            start = int(first)
            end = int(last) + 1 if last else len(data)
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            data, status = data[start:end], 206
        self._record(request, repo_id, status, path, "file")
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(data))
            return web.Response(status=status, headers=headers)
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = len(data)
        await response.prepare(request)
        key = (repo_id, path)
        if key in self.drop_once:
            cut = self.drop_once.pop(key)
            with self._lock:
                self.requests[-1]["dropped_after"] = cut
            await response.write(data[:cut])
            await asyncio.sleep(0.05)  # let the half reach the client before the connection goes
            request.transport.abort()
            return response
        await response.write(data)
        await response.write_eof()
        return response
