"""A local fake of the Hugging Face Hub HTTP API: the part huggingface_hub 2.4 calls to create a repo, upload
a folder (preupload answers "regular" for every file, so contents arrive base64-encoded in the ndjson commit and
neither LFS nor Xet is needed) and to download files (hf_hub_download, from_pretrained, timm's hf-hub:).

    with FakeHub() as hub:          # 127.0.0.1, free port, own thread; shuts itself down after lifetime_s
        hub.add_folder("someuser/tiny", folder)     # a read-only repo holding a local folder
        hub.fail("commit", 500)                     # every commit request answers 500
        hub.files("someuser/tiny")                  # {path: bytes} at main

`use_fake_hub(monkeypatch, hub, tmp_path)` points huggingface_hub (environment and its import-time constants)
at the server, with a dummy token and a fresh cache under tmp_path."""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = "hf_fake_token_for_tests"
USER = "someuser"
REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [  # (name, method, pattern on the undecoded path)
    ("create", "POST", r"/api/repos/create"),
    ("delete", "DELETE", r"/api/repos/delete"),
    ("whoami", "GET", r"/api/whoami-v2"),
    ("validate", "POST", r"/api/validate-yaml"),
    ("preupload", "POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)"),
    ("commit", "POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)"),
    ("branch", "POST", rf"/api/models/{REPO}/branch/(?P<rev>[^/]+)"),
    ("tree", "GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?"),
    ("info", "GET", rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?"),
    ("resolve", "GET", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
    ("resolve", "HEAD", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
]
WRITES = {"create", "delete", "preupload", "commit", "branch", "validate"}


def git_blob_sha(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Repo:
    private: bool = False
    read_only: bool = False
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> {path: content}

    def commit(self, branch: str, files: dict[str, bytes], message: str) -> str:
        parent = self.branches.get(branch, "")
        digest = hashlib.sha1(f"{parent}\n{message}\n{len(self.commits)}".encode())
        for path in sorted(files):
            digest.update(f"{path}:{git_blob_sha(files[path])}".encode())
        sha = digest.hexdigest()
        self.commits[sha], self.branches[branch] = dict(files), sha
        return sha

    def resolve(self, revision: str) -> str | None:
        return self.branches.get(revision) or (revision if revision in self.commits else None)


class FakeHub:
    def __init__(self, *, token: str = TOKEN, lifetime_s: float = 300.0):
        self.token, self.lifetime_s = token, lifetime_s
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for debugging and asserts
        self.failures: dict[str, int] = {}  # route name -> status every such request gets
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.hub = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.timer = threading.Timer(lifetime_s, self.httpd.shutdown)  # never outlives a stuck test
        self.timer.daemon = True

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    # --- what tests call ------------------------------------------------------------------------

    def add_folder(self, repo_id: str, folder: str | Path, *, read_only: bool = True, private: bool = False) -> str:
        """Serve every file of a local folder as repo_id at main; returns the commit sha."""
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        with self.lock:
            repo = self.repos.setdefault(repo_id, Repo(private=private, read_only=read_only))
            return repo.commit("main", files, f"add {folder.name}")

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        with self.lock:
            repo = self.repos[repo_id]
            return dict(repo.commits[repo.resolve(revision)])

    def fail(self, route: str, status: int) -> None:
        self.failures[route] = status

    def count(self, route_name: str) -> int:
        return sum(1 for method, path in self.requests if route_of(method, path)[0] == route_name)


def route_of(method: str, raw_path: str) -> tuple[str | None, dict]:
    path = urlsplit(raw_path).path
    for name, route_method, pattern in ROUTES:
        match = re.fullmatch(pattern, path)
        if match and route_method == method:
            return name, {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
    return None, {}


class Handler(BaseHTTPRequestHandler):
    server_version = "FakeHub/1"

    def log_message(self, format, *args) -> None:  # keep pytest output clean
        pass

    @property
    def hub(self) -> FakeHub:
        return self.server.hub

    def do_GET(self) -> None:
        self.handle_request("GET")

    def do_HEAD(self) -> None:
        self.handle_request("HEAD")

    def do_POST(self) -> None:
        self.handle_request("POST")

    def do_DELETE(self) -> None:
        self.handle_request("DELETE")

    # --- plumbing -------------------------------------------------------------------------------

    def send(self, status: int, body: bytes | dict | list = b"", headers: dict | None = None) -> None:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def error(self, status: int, message: str, code: str | None = None, commit: str | None = None) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        self.send(status, {"error": message}, headers)

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def authorised(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {self.hub.token}"

    def handle_request(self, method: str) -> None:
        hub = self.hub
        hub.requests.append((method, self.path))
        name, params = route_of(method, self.path)
        if name is None:
            self.body()
            return self.error(404, f"the fake Hub has no route for {method} {self.path}")
        if name in hub.failures:
            self.body()
            return self.error(hub.failures[name], f"injected failure of {name}")
        if (name in WRITES or name == "whoami") and not self.authorised():
            self.body()
            return self.error(401, "Invalid credentials in Authorization header")
        with hub.lock:
            getattr(self, f"route_{name}")(**params)

    def repo(self, repo_id: str, revision: str | None = None) -> tuple[Repo, str] | None:
        """The repo and the commit a revision names, or None after answering the matching 404."""
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not self.authorised()):
            self.error(404, f"Repository {repo_id} not found", "RepoNotFound")
            return None
        commit = repo.resolve(revision or "main")
        if commit is None:
            self.error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return None
        return repo, commit

    # --- routes ---------------------------------------------------------------------------------

    def route_create(self) -> None:
        payload = json.loads(self.body())
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        url = f"{self.hub.endpoint}/{repo_id}"
        if repo_id in self.hub.repos:
            return self.send(409, {"error": "You already created this model repo", "url": url},
                             {"X-Error-Message": "You already created this model repo"})
        repo = Repo(private=payload.get("visibility") == "private" or bool(payload.get("private")))
        repo.commit("main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"},
                    "initial commit")
        self.hub.repos[repo_id] = repo
        self.send(200, {"url": url, "name": repo_id, "id": repo_id})

    def route_delete(self) -> None:
        payload = json.loads(self.body())
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        if self.hub.repos.pop(repo_id, None) is None:
            return self.error(404, f"Repository {repo_id} not found", "RepoNotFound")
        self.send(200, {})

    def route_whoami(self) -> None:
        self.send(200, {"type": "user", "name": USER, "auth": {"accessToken": {"role": "write"}}})

    def route_validate(self) -> None:
        import yaml
        content = json.loads(self.body())["content"]
        parts = content.split("---\n", 2)
        try:
            metadata = yaml.safe_load(parts[1]) if content.startswith("---\n") and len(parts) == 3 else None
        except yaml.YAMLError as error:
            return self.send(400, {"errors": [{"message": f"invalid YAML: {error}"}]})
        if not isinstance(metadata, dict):
            return self.send(200, {"errors": [], "warnings": [{"message": "empty or missing metadata"}]})
        self.send(200, {"errors": [], "warnings": []})

    def route_branch(self, repo: str, rev: str) -> None:
        self.body()
        found = self.repo(repo)
        if found is None:
            return
        if rev in found[0].branches:
            return self.error(409, f"Reference {rev} already exists")
        found[0].branches[rev] = found[1]
        self.send(200, {})

    def route_preupload(self, repo: str, rev: str) -> None:
        payload = json.loads(self.body())
        found = self.repo(repo, rev)
        if found is None:
            return
        files = found[0].commits[found[1]]
        self.send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                   "oid": git_blob_sha(files[f["path"]]) if f["path"] in files else None}
                                  for f in payload["files"]]})

    def route_commit(self, repo: str, rev: str) -> None:
        lines = [json.loads(line) for line in self.body().splitlines() if line.strip()]
        found = self.repo(repo, rev)
        if found is None:
            return
        target, commit = found
        if target.read_only:
            return self.error(403, f"{repo} is read-only in this fake Hub")
        files = dict(target.commits[commit])
        header = {}
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "header":
                header = value
            elif key == "file" and value.get("encoding") == "base64":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key == "deletedFolder":
                files = {p: c for p, c in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            else:
                return self.error(400, f"the fake Hub does not support commit operations of kind {key!r}")
        if rev not in target.branches:
            return self.error(400, f"can only commit to a branch, not to {rev}")
        sha = target.commit(rev, files, header.get("summary", ""))
        self.send(200, {"success": True, "commitOid": sha, "commitUrl": f"{self.hub.endpoint}/{repo}/commit/{sha}"})

    def route_info(self, repo: str, rev: str | None = None) -> None:
        found = self.repo(repo, rev)
        if found is None:
            return
        files = found[0].commits[found[1]]
        self.send(200, {"id": repo, "modelId": repo, "sha": found[1], "private": found[0].private, "tags": [],
                        "siblings": [{"rfilename": p, "size": len(c), "blobId": git_blob_sha(c)}
                                     for p, c in sorted(files.items())]})

    def route_tree(self, repo: str, rev: str, path: str = "") -> None:
        found = self.repo(repo, rev)
        if found is None:
            return
        recursive = parse_qs(urlsplit(self.path).query).get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        entries, folders = [], set()
        for name, content in sorted(found[0].commits[found[1]].items()):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            entries.append({"type": "file", "path": name, "size": len(content), "oid": git_blob_sha(content)})
        entries += [{"type": "directory", "path": f, "size": 0, "oid": "0" * 40} for f in sorted(folders)]
        self.send(200, entries)

    def route_resolve(self, repo: str, rev: str, path: str) -> None:
        found = self.repo(repo, rev)
        if found is None:
            return
        content = found[0].commits[found[1]].get(path)
        if content is None:
            return self.error(404, f"Entry {path} not found", "EntryNotFound", commit=found[1])
        self.send(200, content, {"Content-Type": "application/octet-stream", "ETag": f'"{git_blob_sha(content)}"',
                                 "X-Repo-Commit": found[1], "Accept-Ranges": "none"})


def use_fake_hub(monkeypatch, hub: FakeHub, tmp_path: Path, *, token: str | None = TOKEN) -> Path:
    """Point huggingface_hub at the fake Hub; returns the (empty) HF_HOME under tmp_path."""
    from huggingface_hub import constants
    home = tmp_path / "hf_home"
    values = {"ENDPOINT": hub.endpoint,
              "HUGGINGFACE_CO_URL_TEMPLATE": hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
              "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_TOKEN_PATH": str(home / "token"),
              "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"), "HF_HUB_OFFLINE": False,
              "HF_HUB_DISABLE_TELEMETRY": True}
    for name, value in values.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
           "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
    return home


def write_merge_output(out_dir: str | Path, **overrides) -> dict:
    """Add barrier.json (following the merge output schema) and a barrier.png plot to a model folder."""
    import math

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lambdas = [i / 10 for i in range(11)]
    end_a, end_b = 4.21, 4.37
    line = [(1 - lam) * end_a + lam * end_b for lam in lambdas]
    loss = [y + 1.3 * lam * (1 - lam) * (1 + 0.2 * lam) for y, lam in zip(line, lambdas)]
    excess = [value - y for value, y in zip(loss, line)]
    worst = max(range(len(lambdas)), key=excess.__getitem__)
    barrier = {
        "hf_rebasin_version": "0.1.0", "method": "wm",
        "models": ["EleutherAI/pythia-14m", str(out_dir.parent / "seed2")],
        "architecture": "GPTNeoXForCausalLM", "task": "causal-lm", "alpha": 0.5, "lambdas": lambdas,
        "loss": loss, "perplexity": [math.exp(v) for v in loss], "endpoint_loss": [end_a, end_b],
        "merged_loss": loss[5], "barrier": excess[worst], "barrier_lambda": lambdas[worst],
        "data": {"spec": "text:heldout.txt", "tokens": 16384, "seq_len": 128},
        "settings": {"rounds": 5, "seed": 0},
        "timings": {"load_s": 0.4, "match_s": 1.5, "barrier_s": 6.2, "export_s": 0.3},
        "versions": {"hf_rebasin": "0.1.0", "torch": "2.14.1", "transformers": "5.24.0", "timm": "1.0.31"},
        "command": f"hf-rebasin merge EleutherAI/pythia-14m {out_dir.parent / 'seed2'} --method wm -o {out_dir}",
        "notes": ["LayerNorm gains absorbed into the following linear layers", "embeddings untied"],
        "license": "apache-2.0",
    }
    barrier.update(overrides)
    (out_dir / "barrier.json").write_text(json.dumps(barrier, indent=2))
    figure, axes = plt.subplots(figsize=(4, 3))
    axes.plot(barrier["lambdas"], barrier["loss"], marker="o")
    axes.set_xlabel("λ")
    axes.set_ylabel("loss")
    figure.savefig(out_dir / "barrier.png")
    plt.close(figure)
    return barrier
