"""Issue 52's before and after: how large a burst of poison requests a server survives, and what it costs the
requests beside it. Runs `fovea serve` on the tiny model from this tree, or from an earlier one (--tree DIR, a
`git archive COMMIT fovea | tar -x -C DIR`), side by side:

    python benchmarks/poison_burst.py --out results/poison_burst_COMMIT.json [--tree DIR --label COMMIT]

Per burst size: a victim (greedy, 64 tokens) starts, then N copies of round 2's request (repetition_penalty
1e-300, top_p 0.9) arrive together, ~20 s apart as in the report; recorded: the poison requests' statuses, whether
the victim finished with its tokens alone and in what time, /health after, and whether the engine process is the
one it was. Last, one structured request whose grammar (5,000 chained Lark rules) crashes llguidance: is the server
still up (on a fresh server)?
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
POISON = {
    "messages": [{"role": "user", "content": "hello hello"}],
    "max_tokens": 5,
    "temperature": 1.0,
    "top_p": 0.9,
    "top_k": -1,
    "repetition_penalty": 1e-300,
}
VICTIM = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
CHAIN = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(5000)) + '\nr5000: "a"'


def start(tree: Path, model: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "fovea.cli", "serve", model, "--port", str(port), "--dtype", "float32"]
    command += ["--max-model-len", "1024", "--max-engine-restarts", "3", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    server = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise RuntimeError(server.stdout.read()[-2000:])
        time.sleep(0.2)
    raise RuntimeError("the server did not start")


def engine_pid(server: subprocess.Popen) -> int | None:
    """The server's child with torch loaded."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == server.pid:
                if "libtorch" in (entry / "maps").read_text():
                    return int(entry.name)
        except (OSError, ValueError, IndexError):
            pass
    return None


def status(base: str, path: str, body: dict, timeout: float = 120) -> tuple[int, float, dict]:
    start_time = time.monotonic()
    try:
        reply = httpx.post(base + path, json=body, timeout=timeout)
        return reply.status_code, time.monotonic() - start_time, reply.json()
    except (httpx.HTTPError, ValueError) as error:
        return 0, time.monotonic() - start_time, {"error": type(error).__name__}


def run(tree: Path, label: str, model: str, bursts: list[int]) -> dict:
    port = 8400 + os.getpid() % 500
    base = f"http://127.0.0.1:{port}"
    server = start(tree, model, port)
    report = {"label": label, "tree": str(tree), "bursts": []}
    try:
        solo = status(base, "/v1/completions", VICTIM)[2]["choices"][0]["text"]
        for size in bursts:
            before = engine_pid(server)
            with concurrent.futures.ThreadPoolExecutor(size + 1) as pool:
                victim = pool.submit(status, base, "/v1/completions", VICTIM)
                time.sleep(0.3)  # the victim is running
                poison = list(pool.map(lambda _: status(base, "/v1/chat/completions", POISON)[0], range(size)))
                code, seconds, answer = victim.result()
            try:
                health = httpx.get(base + "/health", timeout=10).status_code
            except httpx.HTTPError:
                health = 0
            text = answer.get("choices", [{}])[0].get("text")
            report["bursts"].append(
                {
                    "size": size,
                    "poison_statuses": {str(s): poison.count(s) for s in sorted(set(poison))},
                    "victim_status": code,
                    "victim_seconds": round(seconds, 3),
                    "victim_tokens_as_alone": text == solo,
                    "health_after": health,
                    "engine_process_kept": before is not None and engine_pid(server) == before,
                    "server_running": server.poll() is None,
                }
            )
            print(label, report["bursts"][-1], flush=True)
            if server.poll() is not None:
                break
            time.sleep(20)
    finally:
        stop(server)
    server = start(tree, model, port)  # a fresh one: the bursts may have ended the first
    try:
        grammar = {**POISON, "repetition_penalty": 1.0, "guided_grammar": CHAIN}
        code, seconds, answer = status(base, "/v1/chat/completions", grammar, timeout=60)
        time.sleep(1)
        report["grammar_crash"] = {
            "status": code,
            "message": str(answer.get("error", {}).get("message", "") if code else answer["error"])[:200],
            "server_running": server.poll() is None,
        }
        print(label, report["grammar_crash"], flush=True)
    finally:
        stop(server)
    return report


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tree", action="append", default=[], help="an earlier tree to run too (repeatable)")
    parser.add_argument("--label", action="append", default=[], help="a name for each --tree")
    parser.add_argument("--bursts", default="10,40,40,40,40")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from fovea.testing.tiny import write_tiny_checkpoint

    model = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny-3b", "tiny-3b", seed=1))
    bursts = [int(n) for n in args.bursts.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    runs = [(Path(tree), label) for tree, label in zip(args.tree, args.label)]
    runs.append((REPO, commit.stdout.strip() or "this tree"))
    results = [run(tree, label, model, bursts) for tree, label in runs]
    Path(args.out).write_text(json.dumps({"bursts": bursts, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
