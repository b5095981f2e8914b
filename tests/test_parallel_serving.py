"""`fovea serve` with several engines or ranks: data-parallel replicas answer like one engine and are all used;
a tensor-parallel worker or a replica that dies stops the server with a clear message instead of a hang; a step
every rank fails fails its request alone, and one that leaves the ranks out of step restarts the engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import random_image
from serving import running_server

from fovea import LLM
from fovea.frontend.async_llm import AsyncLLM

COMMON = ("--max-model-len", "256", "--mm-processor-workers", "0")
LONG = 200  # tokens: a request that stays in flight while another is sent


def solo_texts(model_dir, prompts: list[str], max_tokens: int, ignore_eos: bool = False) -> list[str]:
    """Each prompt alone on an offline engine, with the checkpoint's generation defaults as the server applies
    them: the reference for the server's answers."""
    llm = LLM(str(model_dir), max_model_len=256)
    params = llm.get_default_sampling_params().clone(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text for prompt in prompts]


async def complete_all(base: str, model, prompts: list[str], max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    base + "/v1/completions",
                    json={"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                )
                for prompt in prompts
            )
        )
    assert all(reply.status_code == 200 for reply in replies), [r.text for r in replies if r.status_code != 200]
    return [reply.json()["choices"][0]["text"] for reply in replies]


def labelled(base: str, name: str) -> dict[str, float]:
    """{replica label: value} of one per-replica metric."""
    values = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            replica = line.split('replica="')[1].split('"')[0]
            values[replica] = float(line.rsplit(" ", 1)[1])
    return values


def children(parent: int, marker: str) -> list[int]:
    """Processes whose parent is `parent` and whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == parent and marker in command and "resource_tracker" not in command:
                found.append(int(entry.name))
    return found


def by_start(pids: list[int]) -> list[int]:
    """Processes in the order they started (their start times in /proc: pids wrap around)."""
    return sorted(pids, key=lambda pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]))


def wait_until(check, timeout: float = 120.0, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def test_data_parallel_replicas_answer_like_one_engine_and_a_lost_one_comes_back(tiny_dirs):
    """Two replicas answer like one engine and share the load. Replica 1 is frozen, gets a request, and is killed:
    that request fails with a 503 naming the replica, replica 0 answers its own, /health and /metrics show
    replica 1 down, and it is started again while the server keeps serving."""
    model = tiny_dirs["tiny-3b"]
    prompts = [f"Request {i} asks about" + " the weather" * (i % 4) for i in range(32)]
    expected = solo_texts(model, prompts, 8)
    long_text = solo_texts(model, prompts[:1], LONG, ignore_eos=True)[0]
    with running_server(model, "--data-parallel-size", "2", *COMMON) as (base, proc):
        assert asyncio.run(complete_all(base, model, prompts, 8)) == expected
        added = labelled(base, "fovea:replica_requests_added")
        assert set(added) == {"0", "1"} and sum(added.values()) == 32 and min(added.values()) >= 8, added
        first, second = by_start(children(proc.pid, "spawn_main"))  # replica 0 started first
        os.kill(second, signal.SIGSTOP)

        async def one_each_then_kill():
            async with httpx.AsyncClient(timeout=120) as client:

                def send(max_tokens: int):
                    body = {"prompt": prompts[0], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                    return asyncio.create_task(client.post(base + "/v1/completions", json=body))

                # a long request keeps replica 0 busy (both idle: the first replica takes it), so the next one goes
                # to the frozen replica 1 (the fewest in flight), however fast the first would have finished
                long = send(LONG)
                await asyncio.sleep(0.5)
                short = send(8)
                await asyncio.sleep(2)
                os.kill(second, signal.SIGKILL)
                return await long, await short

        answered, lost = asyncio.run(one_each_then_kill())
        assert answered.status_code == 200 and answered.json()["choices"][0]["text"] == long_text
        assert lost.status_code == 503 and "data-parallel replica 1 stopped" in lost.json()["error"]["message"]
        assert proc.poll() is None  # still serving
        wait_until(lambda: httpx.get(base + "/health").json() == {})  # restarted
        [restarted] = set(children(proc.pid, "spawn_main")) - {first}
        assert labelled(base, "fovea:replica_up") == {"0": 1.0, "1": 1.0}
        assert asyncio.run(complete_all(base, model, prompts[:8], 8)) == expected[:8]
        # a burst of requests whose numbers the sampler cannot take: refused, no replica lost
        poison = {"prompt": "hello hello", "max_tokens": 5, "temperature": 1.0, "repetition_penalty": 1e-300}
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            statuses = list(
                pool.map(lambda _: httpx.post(base + "/v1/completions", json=poison).status_code, range(50))
            )
        assert statuses == [400] * 50 and set(children(proc.pid, "spawn_main")) == {first, restarted}
        # both replicas die at once: nothing serves for a while (503), both come back under the restart budget
        for pid in (first, restarted):
            os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: httpx.get(base + "/health").status_code == 200 and len(children(proc.pid, "spawn_main")) == 2
        )
        assert proc.poll() is None
        wait_until(lambda: labelled(base, "fovea:replica_up") == {"0": 1.0, "1": 1.0})
        assert asyncio.run(complete_all(base, model, prompts[:8], 8)) == expected[:8]
    assert "data-parallel replica 1 stopped" in proc.output and "data-parallel replica 1 restarted" in proc.output
    assert "data-parallel replica 0 restarted" in proc.output


def test_a_request_goes_to_the_replica_that_encoded_its_images_unless_it_is_much_busier():
    import collections

    from fovea.frontend.replica_routing import AFFINITY_SLACK, IMAGE_HOMES, pick_replica

    homes = collections.OrderedDict()
    assert pick_replica([0, 1], [0, 0], homes, ["a"]) == 0  # new: the least busy
    assert pick_replica([0, 1], [1, 0], homes, ["b"]) == 1
    assert pick_replica([0, 1], [AFFINITY_SLACK, 0], homes, ["a", "c"]) == 0  # a's replica, not much busier
    assert homes["c"] == 0
    assert pick_replica([0, 1], [AFFINITY_SLACK + 1, 0], homes, ["a"]) == 1  # too much busier: the least busy,
    assert pick_replica([0, 1], [0, 0], homes, ["a"]) == 1  # which now holds a
    assert pick_replica([0], [3, 0], homes, ["b"]) == 0  # b's replica is down
    assert pick_replica([0, 1], [2, 1], homes, []) == 1  # text: the least busy
    for i in range(IMAGE_HOMES + 5):
        pick_replica([0, 1], [0, 0], homes, [str(i)])
    assert len(homes) == IMAGE_HOMES and "0" not in homes  # bounded, the oldest forgotten


def test_an_image_sent_again_is_answered_from_its_replicas_encoder_cache(tiny_dirs):
    """Two replicas; an image goes to replica 0 (both idle), then a long request keeps replica 0 busy. The same
    image again (after another question: no prefix in common) still goes to replica 0 (the fewest-in-flight rule
    alone would send it to the idle replica 1, whose encoder has never seen it): its encoder cache answers. A new
    image goes to replica 1."""
    from test_llava_serving import data_url

    model = tiny_dirs["tiny-3b"]
    seen, new = data_url(random_image(120, 90, seed=1)), data_url(random_image(100, 80, seed=2))

    def chat(url, question="What is it?"):  # the question first: a prompt sent again differs before its image
        content = [{"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": url}}]
        return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}

    def counter(base, name) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(base + "/metrics").text.splitlines()
                   if line.startswith(name + "_total") or line.startswith(name + " "))  # fmt: skip

    with running_server(model, "--data-parallel-size", "2", *COMMON) as (base, _):
        assert httpx.post(base + "/v1/chat/completions", json=chat(seen), timeout=120).status_code == 200

        async def behind_a_long_request():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"prompt": "Once", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
                long = asyncio.create_task(client.post(base + "/v1/completions", json=body))
                await asyncio.sleep(0.5)
                again = await client.post(base + "/v1/chat/completions", json=chat(seen, "And now?"))
                other = await client.post(base + "/v1/chat/completions", json=chat(new))
                return [(await long).status_code, again.status_code, other.status_code]

        assert asyncio.run(behind_a_long_request()) == [200, 200, 200]
        assert labelled(base, "fovea:replica_requests_added") == {"0": 3.0, "1": 1.0}
        assert counter(base, "fovea:encoder_cache_hits") == 1


def test_killed_tensor_parallel_worker_stops_the_server_with_its_message(tiny_dirs):
    """The server stops (an engine missing a rank cannot go on), saying why, and leaves no process of its own
    running (issue 56)."""
    model = tiny_dirs["tiny-3b"]
    prompts = ["Tensor parallel serving says", "Another prompt for two ranks"]
    expected = solo_texts(model, prompts, 6)
    with running_server(model, "--tensor-parallel-size", "2", *COMMON) as (base, proc):
        assert asyncio.run(complete_all(base, model, prompts, 6)) == expected
        (engine,) = children(proc.pid, "spawn_main")
        (worker,) = children(engine, "fovea.runner.tp_workers")
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) >= 3  # the engine, the other rank, and the front end's helpers
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(timeout=60) != 0
    assert f"tensor-parallel worker rank 1 stopped (pid {worker}, signal 9)" in proc.output, proc.output[-2000:]
    deadline = time.time() + 10
    while still_running(tree) and time.time() < deadline:
        time.sleep(0.2)
    assert not still_running(tree), [(p.pid, p.cmdline()) for p in still_running(tree)]


def still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


def test_ray_replicas_are_actors_that_answer_like_one_engine_and_a_killed_one_comes_back(tiny_dirs):
    """--distributed-executor-backend ray with DP=2 x TP=2: each replica's engine core is a Ray actor in its own
    placement group, its second rank an actor in the same group; a killed replica's actor is started again (a new
    placement group) while the other serves."""
    import ray

    model = tiny_dirs["tiny-3b"]
    prompts = [f"Replica on Ray number {i} says" + " more" * (i % 3) for i in range(12)]
    expected = solo_texts(model, prompts, 8)
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": random_image(120, 90, 7)},
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]
    solo = LLM(str(model), max_model_len=256)
    expected_chat = (
        solo.chat(chat, solo.get_default_sampling_params().clone(temperature=0, max_tokens=8), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False)
    fatal = threading.Event()
    engine = None
    try:
        # one decoding worker: the image's pixels reach the front end in shared memory, which it copies out
        engine = AsyncLLM.from_args(
            str(model),
            max_model_len=256,
            mm_processor_workers=1,
            data_parallel_size=2,
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
        )
        engine.on_fatal = fatal.set
        params = engine.default_params.clone(temperature=0, max_tokens=8)

        async def answer(prompt: str | None = None, messages: list | None = None) -> str:
            async for output in engine.generate(prompt, params, messages=messages):
                text = output.outputs[0].text
            return text

        async def answer_all():
            return await asyncio.gather(*(answer(prompt) for prompt in prompts), answer(messages=chat))

        assert asyncio.run(answer_all()) == expected + [expected_chat]
        # the image decoding worker only: no engine process here, the cores run in Ray's workers
        assert len(children(os.getpid(), "spawn_main")) == 1
        assert min(stats.num_requests_added for stats in engine._replica_stats) >= 3
        groups = [group for group in ray.util.placement_group_table().values() if group["state"] == "CREATED"]
        assert sorted(len(group["bundles"]) for group in groups) == [2, 2]
        killed = engine._engines[1]
        ray.kill(killed.process.actor)
        wait_until(lambda: engine._engines[1] is not killed and not engine.replicas_down, timeout=300)
        assert not fatal.is_set() and engine.error is None
        assert asyncio.run(answer_all()) == expected + [expected_chat]
    finally:
        if engine is not None:
            engine.shutdown()
        ray.shutdown()


POISON_PROMPTS = ["Tensor parallel serving says", "Another prompt for two ranks"]


@contextlib.contextmanager
def poison_sent(tiny_dirs, tmp_path, ranks: str):
    """A two-rank server whose steps holding test_tensor_parallel's POISON token fail on `ranks` ("all", "0", "workers"),
    sent the POISON request and then POISON_PROMPTS beside it: yields the server, its engine process before, the
    replies (the poison's, then the others') and the others' texts as one process makes them."""
    from test_tensor_parallel import POISON_HOOK

    model = tiny_dirs["tiny-3b"]
    expected = solo_texts(model, POISON_PROMPTS, 6)
    (tmp_path / "sitecustomize.py").write_text(POISON_HOOK)
    env = {"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}", "FOVEA_TEST_POISON_RANKS": ranks}
    env["FOVEA_TEST_SETTLE_WAIT_S"] = "2"  # (a worker's wait for rank 0's word)
    with running_server(model, "--tensor-parallel-size", "2", *COMMON, env=env) as (base, proc):
        (engine,) = children(proc.pid, "spawn_main")

        async def send():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"model": str(model), "prompt": [4242, *range(300, 320)], "max_tokens": 6}
                poison = asyncio.create_task(client.post(base + "/v1/completions", json=body))
                await asyncio.sleep(0.2)
                others = [{"model": str(model), "prompt": p, "max_tokens": 6} for p in POISON_PROMPTS]
                replies = await asyncio.gather(*(client.post(base + "/v1/completions", json=o) for o in others))
                return [await poison, *replies]

        yield base, proc, engine, asyncio.run(send()), expected


def test_a_request_every_rank_fails_on_gets_an_error_and_the_others_their_answers(tiny_dirs, tmp_path):
    """Served on two ranks, a request whose step fails on every rank gets a 500 naming the failure; the requests
    beside it get their own answers, and the server goes on serving with the same engine (not restarted)."""
    with poison_sent(tiny_dirs, tmp_path, "all") as (base, proc, engine, (poison, *replies), expected):
        assert poison.status_code == 500 and "injected" in poison.json()["error"]["message"], poison.text
        assert [r.json()["choices"][0]["text"] for r in replies] == expected
        assert asyncio.run(complete_all(base, tiny_dirs["tiny-3b"], POISON_PROMPTS, 6)) == expected
        assert children(proc.pid, "spawn_main") == [engine]  # the same engine process throughout


@pytest.mark.parametrize(
    "ranks, logged",
    [
        ("0", "RanksOutOfStep: a step failed (RuntimeError: injected"),
        ("workers", "exit code 3); it was out of step with rank 0"),
    ],
    ids=["rank-0", "worker"],
)
def test_ranks_out_of_step_after_a_failed_step_restart_the_engine(tiny_dirs, tmp_path, ranks, logged):
    """The step fails on rank 0 alone, or on the worker alone (which leaves when rank 0 does not say it failed
    too): the ranks are out of step, so the engine process stops (its requests get a 503) and a new one starts,
    which serves as the first did."""
    with poison_sent(tiny_dirs, tmp_path, ranks) as (base, proc, engine, (poison, *_), expected):
        assert poison.status_code == 503 and "stopped unexpectedly" in poison.text, poison.text
        deadline = time.time() + 120
        while httpx.get(base + "/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.5)
        assert asyncio.run(complete_all(base, tiny_dirs["tiny-3b"], POISON_PROMPTS, 6)) == expected
        assert children(proc.pid, "spawn_main") not in ([], [engine])  # a new engine process
    assert logged in proc.output, proc.output[-3000:]
