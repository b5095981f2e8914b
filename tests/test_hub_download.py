"""Hub ids: downloaded through huggingface_hub from HF_ENDPOINT (a local server speaking the hub's HTTP API with a
tiny checkpoint), reused from the cache offline, and a clear `hf download` message when neither works."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO, SHA = "tiny-org/tiny-vl", "0123456789abcdef0123456789abcdef01234567"


def hub_server(model_dir: Path) -> ThreadingHTTPServer:
    """The calls snapshot_download makes: the repository's description and file list, then each file."""
    files = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    requested: list[str] = []

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _file(self, body: bool):
            prefix = f"/{REPO}/resolve/"
            name = self.path.split("?")[0][len(prefix) :].split("/", 1)[1] if self.path.startswith(prefix) else ""
            if name not in files:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.end_headers()
                return
            data = (model_dir / name).read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", SHA)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                requested.append(name)
                self.wfile.write(data)

        def do_HEAD(self):
            self._file(body=False)

        def do_GET(self):
            if self.path.startswith(f"/api/models/{REPO}"):
                if self.path.startswith(f"/api/models/{REPO}/tree/"):  # the file listing
                    body = [
                        {
                            "type": "file",
                            "path": name,
                            "size": (model_dir / name).stat().st_size,
                            "oid": hashlib.sha1((model_dir / name).read_bytes()).hexdigest(),
                        }
                        for name in files
                    ]
                else:  # the repository's description
                    body = {
                        "id": REPO,
                        "modelId": REPO,
                        "sha": SHA,
                        "private": False,
                        "siblings": [{"rfilename": name} for name in files],
                    }
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path.startswith("/api/"):
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
            else:
                self._file(body=True)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    server.requested = requested
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


RESOLVE = "from fovea.config.model import resolve_model_dir; import sys; print(resolve_model_dir(sys.argv[1]))"


def resolve(model: str, env: dict) -> subprocess.CompletedProcess:
    # huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when imported: a fresh interpreter for each setting
    return subprocess.run(
        [sys.executable, "-c", RESOLVE, model], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_hub_id_is_downloaded_then_found_offline(tiny_dirs, tmp_path):
    source = tiny_dirs["tiny-3b"]
    server = hub_server(source)
    env = {
        "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_OFFLINE": "0",
    }
    try:
        online = resolve(REPO, env)
        assert online.returncode == 0, online.stderr[-2000:]
        downloaded = Path(online.stdout.strip())
        expected = {p.name for p in source.iterdir() if p.suffix in (".json", ".safetensors", ".jinja", ".txt")}
        assert expected and set(server.requested) == expected
        for name in expected:
            assert (downloaded / name).read_bytes() == (source / name).read_bytes()
        missing = resolve("tiny-org/not-there", env)
        assert missing.returncode != 0 and "could not be downloaded" in missing.stderr
        assert "`hf download tiny-org/not-there`" in missing.stderr
    finally:
        server.shutdown()
    offline = resolve(REPO, {**env, "HF_HUB_OFFLINE": "1"})  # the server is gone: the cache answers
    assert offline.returncode == 0 and Path(offline.stdout.strip()) == downloaded, offline.stderr[-2000:]
    absent = resolve("tiny-org/other", {**env, "HF_HUB_OFFLINE": "1"})
    assert "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in absent.stderr
    assert "`hf download tiny-org/other`" in absent.stderr
