"""fovea across two test hosts (network namespaces on this machine, tests/hosts.py): a Ray head on host A, a worker
node on host B, each with 2 Ray CPUs, so that a replica of 2 CPUs fits one host whole and two replicas take one
host each.

Serving: `fovea serve --distributed-executor-backend ray -dp 2 -tp 2` started on A: each replica's engine core and
its second rank on one host; the front end on A decodes the images and videos, so their pixels cross the link to
B's replica. Every answer equals the one engine's in this process, and both replicas serve.
Faults: host B's Ray node stopped mid-load: the requests its replica ran fail with a 503 naming the replica, the
server goes on serving on A, /health and /metrics say the replica is down, and it comes back when host B does.
Eval: `fovea eval --ray --num-replicas 2 --cpus-per-replica 2` started on A gives the in-process predictions."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import jpeg_bytes, random_image, video_file
from hosts import two_hosts, unavailable
from serving import running_server
from test_eval_backends import ENGINE, SAME_FIELDS, read_outputs, task_file  # noqa: F401 - task_file: a fixture

from fovea import LLM

pytest.importorskip("ray", reason="Ray is in the test extras")
why = unavailable()
pytestmark = pytest.mark.skipif(why is not None, reason=f"no test hosts: {why}")

MAX_TOKENS = 6


def requests() -> list[list[dict]]:
    """Chats: text, an image, a video (data URLs: decoded by the front end on host A)."""
    image = "data:image/jpeg;base64," + base64.b64encode(jpeg_bytes(random_image(112, 84, seed=7))).decode()
    frames = np.random.default_rng(1).integers(0, 255, (4, 56, 84, 3), dtype=np.uint8)
    video = "data:video/mp4;base64," + base64.b64encode(video_file(frames, fps=2, lossless=False)).decode()
    chats = [[{"role": "user", "content": f"Question {i} about the sea and" + " boats" * i}] for i in range(6)]
    for i in range(3):
        chats.append(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": f"Look {i}"}]}]
        )  # fmt: skip
    chats.append([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video}}, {"type": "text", "text": "What moves?"}]}])  # fmt: skip
    return chats


async def post_all(base: str, chats) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(
            *(
                client.post(
                    base + "/v1/chat/completions", json={"messages": m, "max_tokens": MAX_TOKENS, "temperature": 0}
                )
                for m in chats
            )
        )


async def chat_all(base: str, chats) -> list[str]:
    replies = await post_all(base, chats)
    assert all(r.status_code == 200 for r in replies), [r.text[:300] for r in replies if r.status_code != 200]
    return [r.json()["choices"][0]["message"]["content"] for r in replies]


def per_replica(base: str, name: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            values[line.split('replica="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return values


@pytest.fixture(scope="module")
def cluster():
    with two_hosts(cpus=(2, 2)) as made:
        yield made


def wait_until(check, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(1)


async def long_completions(base: str, count: int, stop_host) -> list[httpx.Response]:
    """`count` long requests in flight over both replicas; `stop_host` is called once they run."""
    async with httpx.AsyncClient(timeout=300) as client:
        body = {"prompt": "A long story:", "max_tokens": 400, "min_tokens": 400, "temperature": 0}
        sent = [asyncio.create_task(client.post(base + "/v1/completions", json=body)) for _ in range(count)]
        await asyncio.sleep(3)
        await asyncio.to_thread(stop_host)
        return await asyncio.gather(*sent)


def test_replicas_on_two_hosts_answer_like_one_engine_and_survive_a_lost_host(tiny_dirs, cluster):
    model = tiny_dirs["tiny-3b"]
    chats = requests()
    llm = LLM(str(model), max_model_len=512, dtype="float32")
    params = llm.get_default_sampling_params().clone(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in llm.chat(chats, params, use_tqdm=False)]
    llm.close()
    flags = ["--dtype", "float32", "--max-model-len", "512", "--distributed-executor-backend", "ray"]
    flags += ["-dp", "2", "-tp", "2"]
    a, b = cluster.hosts
    with running_server(
        model, *flags, env=cluster.env, prefix=a.command(), address=cluster.client_address, startup_s=300
    ) as (base, proc):
        assert asyncio.run(chat_all(base, chats)) == expected
        added = per_replica(base, "fovea:replica_requests_added")
        assert set(added) == {"0", "1"} and min(added.values()) >= 1, added  # both hosts' replicas served
        ray = str(Path(sys.executable).with_name("ray"))

        def whole_replica_on_each_host() -> bool:
            usage = subprocess.run(a.command(ray, "status", "-v"), capture_output=True, text=True, env=cluster.env)
            return usage.stdout.count("2.0/2.0 CPU") == 2

        # polled: CI once read "1.0/2.0 CPU" on a host whose replica had just answered with both of its ranks (the
        # usage `ray status` prints is what the nodes last reported)
        wait_until(whole_replica_on_each_host, timeout=30)

        replies = asyncio.run(long_completions(base, 4, lambda: cluster.stop_node(b)))
        failed = [r for r in replies if r.status_code != 200]
        assert failed and len(failed) < len(replies), [r.text[:300] for r in replies]  # B's failed, A's finished
        lost = failed[0].json()["error"]
        assert failed[0].status_code == 503 and "data-parallel replica" in lost["message"], lost
        replica = int(lost["message"].split("data-parallel replica ")[1].split()[0])
        assert httpx.get(base + "/health").json() == {"replicas_down": [replica]}
        assert per_replica(base, "fovea:replica_up")[str(replica)] == 0
        assert asyncio.run(chat_all(base, chats)) == expected  # host A serves everything meanwhile
        assert proc.poll() is None

        cluster.start_node(b, 2)  # host B is back: its replica is placed there again
        wait_until(lambda: httpx.get(base + "/health").json() == {})
        assert per_replica(base, "fovea:replica_up") == {"0": 1.0, "1": 1.0}
        before = per_replica(base, "fovea:replica_requests_added")[str(replica)]
        assert asyncio.run(chat_all(base, chats)) == expected
        assert per_replica(base, "fovea:replica_requests_added")[str(replica)] > before  # serving again


def image_chats(seeds) -> list[list[dict]]:
    chats = []
    for seed in seeds:
        url = "data:image/jpeg;base64," + base64.b64encode(jpeg_bytes(random_image(98, 70, seed=seed))).decode()
        chats.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "And?"}]}])  # fmt: skip
    return chats


def test_encoder_workers_on_both_hosts_give_the_colocated_tokens_and_come_back(tiny_dirs, cluster):
    """`-dp 2 --mm-encoder-workers 2` under Ray: two replicas' engine cores and two encoder actors that both
    replicas share fill the cluster's four CPUs (an encoder pair per replica would not fit), so images and the
    video go through Ray's object store to actors on both hosts; every answer is the engine's own in this process,
    and both replicas answered. Host B's actor killed: Ray restarts it and its jobs run again there, so new images
    are answered the same, none failed."""
    import psutil

    model = tiny_dirs["tiny-3b"]
    chats, later, again = requests(), image_chats(range(20, 24)), image_chats(range(30, 36))
    llm = LLM(str(model), max_model_len=512, dtype="float32")
    params = llm.get_default_sampling_params().clone(temperature=0, max_tokens=MAX_TOKENS)
    expected, expected_later, expected_again = (
        [o.outputs[0].text for o in llm.chat(c, params, use_tqdm=False)] for c in (chats, later, again)
    )
    llm.close()
    a, b = cluster.hosts
    flags = ["--dtype", "float32", "--max-model-len", "512", "--distributed-executor-backend", "ray"]

    def encoders_on(host) -> list:
        pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout.split()
        found = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):  # gone, or a zombie
                process = psutil.Process(int(pid))
                if "EncoderActor" in " ".join(process.cmdline()) and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
        return found

    with running_server(
        model, *flags, "-dp", "2", "--mm-encoder-workers", "2", env=cluster.env, prefix=a.command(),
        address=cluster.client_address, startup_s=300,
    ) as (base, proc):  # fmt: skip
        assert asyncio.run(chat_all(base, chats)) == expected
        added = per_replica(base, "fovea:replica_requests_added")
        assert set(added) == {"0", "1"} and min(added.values()) >= 1, added
        on_b = encoders_on(b)
        assert len(on_b) == len(encoders_on(a)) == 1, "the replicas share one encoder actor on each host"
        for actor in on_b:
            actor.kill()
        # their jobs, held or sent before Ray saw them die, run again on the restarted actors
        assert asyncio.run(chat_all(base, later)) == expected_later
        killed = {p.pid for p in on_b}
        # restarted where they were: as many, none of them the killed ones
        wait_until(lambda: len({p.pid for p in encoders_on(b)} - killed) == len(killed), timeout=120)
        assert asyncio.run(chat_all(base, again)) == expected_again  # new images, through every actor
        assert asyncio.run(chat_all(base, chats)) == expected
    assert "vision encoder workers (Ray actors) on" in proc.output


def test_eval_replicas_on_two_hosts_give_the_in_process_predictions(tiny_dirs, task_file, cluster, tmp_path):  # noqa: F811
    from fovea.cli import main

    model = str(tiny_dirs["tiny-3b"])
    common = ["eval", "--model", model, "--task", str(task_file), "--max-tokens", "6", *ENGINE]
    main([*common, "--output-dir", str(tmp_path / "in-process")])
    ray = ["--ray", "--ray-address", "auto", "--num-replicas", "2", "--cpus-per-replica", "2"]
    command = [sys.executable, "-m", "fovea.cli", *common, *ray, "--output-dir", str(tmp_path / "hosts")]
    done = subprocess.run(cluster.head.command(*command), capture_output=True, text=True, env=cluster.env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    expected, _ = read_outputs(tmp_path / "in-process")
    predictions, results = read_outputs(tmp_path / "hosts")
    assert "ray: 2 replicas x 2 CPU" in results["backend"]
    assert [{k: p.get(k) for k in SAME_FIELDS} for p in predictions] == [
        {k: p.get(k) for k in SAME_FIELDS} for p in expected
    ]
