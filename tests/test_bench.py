"""`fovea bench serve`: metric math against hand-computed values, workloads, and a run against a live server."""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from serving import GPU_SHARE_FLAGS, free_port, running_server

from fovea.bench.datasets import parse_bucket_config, random_mm_requests, random_requests
from fovea.bench.metrics import RequestResult, compute_metrics, format_table, parse_goodput
from fovea.cli import build_parser
from fovea.multimodal import video_decode

FIELDS = (
    [
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
    ]
    + [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std")]
    + ["p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms"]
)  # percentiles for the default --percentile-metrics


def synthetic_results() -> list[RequestResult]:
    return [
        RequestResult(
            10, 4, start_time=0.0, success=True, ttft=0.1, itl=[0.05, 0.05, 0.1], latency=0.3, output_tokens=4
        ),
        RequestResult(20, 2, start_time=0.5, success=True, ttft=0.2, itl=[0.1], latency=0.3, output_tokens=2),
        RequestResult(5, 1, start_time=1.2, success=True, ttft=0.4, itl=[], latency=0.4, output_tokens=1),
        RequestResult(7, 4, start_time=1.3, success=False, error="HTTP 500"),
    ]


def test_metrics_equal_hand_computed_values():
    m = compute_metrics(
        synthetic_results(),
        duration=2.0,
        goodput={"ttft": 250, "tpot": 90},
        selected=("ttft", "tpot", "itl", "e2el"),
        percentiles=(50, 99),
    )
    expected = {
        "completed": 3,
        "failed": 1,
        "total_input_tokens": 35,
        "total_output_tokens": 7,
        "request_throughput": 1.5,
        "output_throughput": 3.5,
        "total_token_throughput": 21.0,
        "request_goodput": 0.5,  # only the first request meets TTFT <= 250 ms and TPOT <= 90 ms
        "max_output_tokens_per_s": 6,
        "max_concurrent_requests": 1,  # at one instant, as vLLM's sweep counts: the three never overlap
        "mean_ttft_ms": 233.3333,
        "median_ttft_ms": 200,
        "std_ttft_ms": 124.7219,
        "p99_ttft_ms": 396,
        "p50_ttft_ms": 200,
        "mean_tpot_ms": 83.3333,
        "median_tpot_ms": 83.3333,
        "p99_tpot_ms": 99.6667,  # 200/3 and 100 ms
        "mean_itl_ms": 75,
        "median_itl_ms": 75,
        "p99_itl_ms": 100,
        "std_itl_ms": 25,
        "mean_e2el_ms": 333.3333,
        "median_e2el_ms": 300,
        "p99_e2el_ms": 398,
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=1e-3), key
    table = format_table(m, ("ttft", "tpot", "itl", "e2el"), (50, 99))
    lines = [line.rstrip() for line in table.splitlines()]  # rows are padded to 10 columns, as in vLLM
    assert lines[0] == "{:=^50}".format(" Serving Benchmark Result ") and lines[-1] == "=" * 50
    # vLLM's layout: the name left-aligned in 40 columns, a space, the value
    assert f"{'Successful requests:':<40} 3" in lines
    assert f"{'Request goodput (req/s):':<40} 0.50" in lines
    assert "{:-^50}".format("Time per Output Token (excl. 1st token)") in lines
    assert f"{'P99 ITL (ms):':<40} 100.00" in lines


def test_goodput_and_bucket_parsing():
    assert parse_goodput(["ttft:500", "e2el:1e4"]) == {"ttft": 500.0, "e2el": 10000.0}
    for bad in (["ttft500"], ["latency:5"], ["tpot:x"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_bucket_config("{(256,256,1):1,(720,1280,1):3}") == {(256, 256, 1): 0.25, (720, 1280, 1): 0.75}
    assert parse_bucket_config("{(8,8,1):1,(8,8,16):1,(9,9,1):0}") == {(8, 8, 1): 0.5, (8, 8, 16): 0.5}
    for bad in ("{(256,256,0):1}", "[1,2]", "{(256,256):1}", "{(1,1,1):0}", "{oops", "{(1,1,1):-1}"):
        with pytest.raises(ValueError):
            parse_bucket_config(bad)


def test_random_prompts_retokenize_to_the_asked_length(tiny_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dirs["tiny-3b"]))
    requests = random_requests(tokenizer, 12, 100, 20, range_ratio=0.5, prefix_len=10, seed=1)
    special = set(tokenizer.all_special_ids)
    for r in requests:
        ids = tokenizer.encode(r.prompt, add_special_tokens=False)
        assert len(ids) == r.prompt_len and abs(r.prompt_len - (10 + 100)) <= 50 + 1
        assert not special & set(ids) and 10 <= r.output_len <= 30
    assert len({r.prompt[:20] for r in requests}) == 1  # the shared random prefix
    assert len({r.prompt_len for r in requests}) > 3  # lengths spread over the range
    mm = random_mm_requests(
        tokenizer,
        20,
        16,
        4,
        base_items=2,
        items_range_ratio=0.5,
        limits={"image": 2},
        buckets={(28, 56, 1): 1.0},
        seed=2,
    )
    counts = [len(r.images) for r in mm]
    assert min(counts) >= 1 and max(counts) == 2  # 2 +- 50 % capped at the limit of 2
    assert all(url.startswith("data:image/jpeg;base64,") for r in mm for url in r.images)
    # vLLM's buckets with frames > 1 are videos; a modality at its limit leaves the draw
    mixed = random_mm_requests(
        tokenizer,
        20,
        16,
        4,
        base_items=3,
        limits={"image": 3, "video": 1},
        buckets={(28, 56, 1): 0.5, (32, 48, 8): 0.5, (64, 64, 1): 0.0},
        seed=3,
    )
    assert all(len(r.images) + len(r.videos) == 3 and len(r.videos) <= 1 for r in mixed)
    assert 5 <= sum(len(r.videos) for r in mixed) < 20  # half the first draws are videos
    video = base64.b64decode(mixed[[bool(r.videos) for r in mixed].index(True)].videos[0].split(",", 1)[1])
    assert video_decode.probe(video) == video_decode.VideoInfo(8, 30.0, 32, 48)
    with pytest.raises(ValueError, match="over the limits"):
        random_mm_requests(tokenizer, 2, 16, 4, base_items=3, limits={"video": 1}, buckets={(32, 48, 8): 1.0})


def bench(*flags):
    args = build_parser().parse_args(["bench", "serve", *flags, "--disable-tqdm"])
    return args.func(args)


KEY = "sk-env"


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def served(tiny_dirs, profiles):
    """One server for the file's runs against a live server, with a key (VLLM_API_KEY, as vLLM's server reads it)
    and a folder for profiles (VLLM_TORCH_PROFILER_DIR)."""
    flags = ["--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override", "300"]
    env = {"VLLM_API_KEY": KEY, "VLLM_TORCH_PROFILER_DIR": str(profiles)}
    with running_server(tiny_dirs["tiny-3b"], *flags, "--served-model-name", "tiny", env=env) as (base, _):
        yield base


def test_bench_profile_has_the_engine_write_a_trace_of_the_run(tiny_dirs, served, profiles, monkeypatch):
    """--profile, as vLLM's: /start_profile before the run and /stop_profile after; the engine process writes one
    gzipped Chrome trace of its steps (the model's operators in it) into VLLM_TORCH_PROFILER_DIR."""
    import gzip

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    flags = ["--base-url", served, "--tokenizer", str(tiny_dirs["tiny-3b"]), "--num-prompts", "2"]
    result = bench(*flags, "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos", "--profile")
    assert result["completed"] == 2
    deadline = time.time() + 60
    while not list(profiles.glob("engine-*.pt.trace.json.gz")) and time.time() < deadline:
        time.sleep(0.2)
    [trace] = profiles.glob("engine-*.pt.trace.json.gz")
    names = {event.get("name", "") for event in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
    assert any(name.startswith("aten::mm") or name.startswith("aten::linear") for name in names)
    # the development route to reset the prefix cache needs VLLM_SERVER_DEV_MODE=1, as in vLLM (tests/test_server.py)
    assert httpx.post(served + "/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_bench_serve_against_a_live_server(tiny_dirs, served, tmp_path, capsys, monkeypatch):
    model, base = str(tiny_dirs["tiny-3b"]), served
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    common = ["--base-url", base, "--tokenizer", model, "--ignore-eos", "--random-output-len", "6"]
    result = bench(
        *common,
        "--num-prompts",
        "8",
        "--random-input-len",
        "40",
        "--request-rate",
        "10",
        "--burstiness",
        "100",
        "--save-detailed",
        "--result-dir",
        str(tmp_path),
        "--label",
        "t",
        "--metadata",
        "hardware=cpu",
        "--goodput",
        "e2el:60000",
        "--num-warmups",
        "1",
        "--plot",
        str(tmp_path / "run.png"),
    )
    table = capsys.readouterr().out
    # a served name and no --tokenizer: the server's own directory, not the hub (once ~50 s of retries)
    named = bench("--base-url", base, "--model", "tiny", "--num-prompts", "2", "--random-input-len", "12",
                  "--random-output-len", "2", "--ignore-eos")  # fmt: skip
    assert named["completed"] == 2 and named["total_input_tokens"] == 24
    with pytest.raises(ValueError, match="no tokenizer at .*pass --tokenizer DIR"):
        bench("--base-url", base, "--tokenizer", str(tmp_path / "nothing-here"), "--num-prompts", "1")
    mm = bench(
        *common,
        "--num-prompts",
        "3",
        "--random-input-len",
        "12",
        "--dataset-name",
        "random-mm",
        "--backend",
        "openai-chat",
        "--random-mm-bucket-config",
        "{(56, 84, 1): 0.5, (56, 84, 6): 0.5}",
        "--random-mm-base-items-per-request",
        "2",
        "--random-mm-limit-mm-per-prompt",
        '{"image": 1, "video": 1}',
    )
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 8 * 6 and result["output_lens"] == [6] * 8
    assert result["total_input_tokens"] == 8 * 40 and result["request_goodput"] == result["request_throughput"]
    saved = json.loads(next(tmp_path.glob("t-10.0qps-tiny-*.json")).read_text())
    assert all(name in saved for name in FIELDS) and saved["hardware"] == "cpu" and saved["model_id"] == "tiny"
    # gamma(100) arrivals at 10/s, sent at times planned up front: gaps close to 100 ms (one sent late on a busy
    # machine shortens the next gap, so the median), the last 0.7 s after the first (at 0.1 s and 0.8 s)
    starts = sorted(saved["start_times"])
    assert 0.08 < np.median(np.diff(starts)) < 0.12 and 0.6 < starts[-1] - starts[0] < 0.8, np.diff(starts)
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table
    assert mm["completed"] == 3 and mm["total_output_tokens"] == 18
    # the server's usage: each prompt's 12 text tokens plus its chat template, an image of 6 tokens and a video
    # (6 frames at 30 fps: 4 kept, 2 temporal patches of 6 tokens)
    assert mm["total_input_tokens"] > 3 * (12 + 6 + 12) and mm["failed"] == 0
    assert (saved["backend"], saved["endpoint_type"], mm["backend"]) == ("openai", "openai", "openai-chat")
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_throughput_compares_with_hf_and_latency_runs(tiny_dirs, tmp_path, capsys):
    model = str(tiny_dirs["tiny-3b"])
    common = ["--model", model, "--dtype", "float32", "--max-model-len", "1024", *GPU_SHARE_FLAGS]
    parser = build_parser()
    args = parser.parse_args(
        [
            "bench",
            "throughput",
            *common,
            "--compare",
            "hf",
            "--dataset-name",
            "random-mm",
            "--num-prompts",
            "6",
            "--random-input-len",
            "24",
            "--random-output-len",
            "5",
            "--random-mm-bucket-config",
            "{(56, 84, 1): 1.0}",
            "--random-mm-base-items-per-request",
            "1",
            "--output-json",
            str(tmp_path / "t.json"),
        ]
    )
    result = args.func(args)
    printed = capsys.readouterr().out
    assert "fovea  Throughput:" in printed and "hf     Throughput:" in printed and "fovea/hf:" in printed
    assert result["fovea"]["output_tokens"] == result["hf"]["output_tokens"] == 30
    assert result["identical_outputs"] == 6  # greedy, fp32: the same tokens as transformers
    assert json.loads((tmp_path / "t.json").read_text())["ratio"] == pytest.approx(result["ratio"])
    args = parser.parse_args(
        [
            "bench",
            "latency",
            *common,
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--batch-size",
            "2",
            "--num-iters",
            "3",
            "--num-iters-warmup",
            "1",
        ]
    )
    latency = args.func(args)
    assert len(latency["latencies"]) == 3 and set(latency["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert "Avg latency:" in capsys.readouterr().out
    # vLLM's --n and --use-beam-search: every beam of every prompt runs to the output length (EOS ignored)
    beams = parser.parse_args(["bench", "throughput", *common, "--num-prompts", "2", "--random-input-len", "16"]
                              + ["--random-output-len", "3", "--n", "3", "--use-beam-search"])  # fmt: skip
    assert beams.func(beams)["fovea"]["output_tokens"] == 2 * 3 * 3
    refused = parser.parse_args(["bench", "throughput", *common, "--backend", "hf", "--n", "2"])
    with pytest.raises(ValueError, match="run on fovea's backends only"):
        refused.func(refused)


def test_vllms_offline_bench_flags(tiny_dirs, tmp_path, monkeypatch):
    """vLLM's `bench throughput` and `bench latency` lines run: --backend vllm (prompts as they are) and vllm-chat,
    prompt tokens as the engine counts them, vLLM's top-level --output-json fields, --prefix-len and --dataset,
    --hf-max-batch-size, --disable-detokenize, --profile (a trace where VLLM_TORCH_PROFILER_DIR says), --lora-path
    (with --enable-lora), --async-engine accepted."""
    model = str(tiny_dirs["tiny-3b"])
    common = ["--model", model, "--dtype", "float32", "--max-model-len", "1024", *GPU_SHARE_FLAGS]
    workload = ["--num-prompts", "4", "--input-len", "20", "--output-len", "3", "--prefix-len", "4"]
    parser = build_parser()

    def run(*flags):
        args = parser.parse_args(["bench", "throughput", *common, *workload, *flags])
        return args.func(args)

    raw = run("--backend", "vllm", "--async-engine", "--output-json", str(tmp_path / "raw.json"))
    chat = run("--backend", "vllm-chat", "--compare", "hf", "--hf-max-batch-size", "3", "--disable-detokenize")
    assert raw["vllm"]["total_num_tokens"] == 4 * (4 + 20 + 3)  # the random prompts' own 24 tokens each
    template = chat["vllm-chat"]["total_num_tokens"] - 4 * 27
    assert template > 4 * 10 and chat["hf"]["total_num_tokens"] == chat["vllm-chat"]["total_num_tokens"]
    assert chat["identical_outputs"] == 4  # (hf in batches of 3 and 1)
    saved = json.loads((tmp_path / "raw.json").read_text())
    assert saved["requests_per_second"] == raw["vllm"]["requests_per_second"] and saved["num_requests"] == 4
    with pytest.raises(ValueError, match="--lora-path needs --enable-lora"):
        run("--lora-path", str(tmp_path))
    from test_lora import write_adapter

    adapter = str(write_adapter(model, tmp_path / "adapter", ["q_proj", "v_proj"], seed=3))
    from fovea.bench.datasets import BenchRequest
    from fovea.bench.offline import OfflineRun, throughput

    prompts, engine = [BenchRequest(f"word {i} " * 5, 10, 4) for i in range(4)], {"dtype": "float32"}
    base = throughput(model, prompts, "fovea", {**engine, "enable_lora": True, "max_loras": 2})
    adapted = throughput(
        model, prompts, "fovea", {**engine, "enable_lora": True, "max_loras": 2}, how=OfflineRun(lora_path=adapter)
    )
    assert adapted["output_tokens"] == 16 and adapted["outputs"] != base["outputs"]  # the adapter's tokens
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(ValueError, match="VLLM_TORCH_PROFILER_DIR"):
        run("--profile")
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    run("--profile")
    with pytest.raises(ValueError, match="takes no --dataset-path"):  # (--dataset is vLLM's old name for it)
        run("--dataset", str(tmp_path / "sharegpt.json"))
    args = parser.parse_args(["bench", "latency", *common, "--input-len", "8", "--output-len", "2", "--batch-size",
                              "1", "--num-iters", "1", "--num-iters-warmup", "0", "--profile", "--disable-detokenize"])  # fmt: skip
    args.func(args)
    assert len(list((tmp_path / "traces").glob("*.pt.trace.json.gz"))) == 2


def test_bench_mm_processor_checks_equal_patches(capsys):
    args = build_parser().parse_args(["bench", "mm-processor", "--sizes", "112x84,300x200", "--iters", "1"])
    rows = args.func(args)
    assert [r["size"] for r in rows] == ["112x84", "300x200"] and rows[0]["patches"] == 48  # 8x6 patches of 14
    assert all(r["fovea_median_ms"] > 0 and r["hf_median_ms"] > 0 for r in rows)
    assert "speed-up" in capsys.readouterr().out
    bad = build_parser().parse_args(["bench", "mm-processor", "--sizes", "big"])
    with pytest.raises(ValueError, match="--sizes"):
        bad.func(bad)


def test_sharegpt_and_jsonl_workloads(tiny_dirs, tmp_path):
    from transformers import AutoTokenizer

    from fovea.bench.datasets import jsonl_requests, sharegpt_requests

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dirs["tiny-3b"]))
    long_reply = "word " * 3000
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": "Tell me about the harbour at dawn."},
                {"from": "gpt", "value": "The boats leave early and the gulls follow them out."},
            ]
        },
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend."}]},
        {
            "conversations": [
                {"from": "human", "value": "Write a long story please."},
                {"from": "gpt", "value": long_reply},
            ]
        },  # prompt + reply over 2048 tokens: skipped
        {"conversations": [{"from": "human", "value": "Only one turn"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    [request] = sharegpt_requests(str(path), tokenizer, 1)
    assert request.prompt == "Tell me about the harbour at dawn."  # "Hi" has under 4 tokens
    assert request.output_len == len(tokenizer.encode(conversations[0]["conversations"][1]["value"]))
    assert len(sharegpt_requests(str(path), tokenizer, 2)) == 1  # what there is; vLLM's command line fills up:
    from fovea.bench.cli import build_requests

    flags = ["--tokenizer", "x", "--endpoint", "/v1/completions", "--dataset-name", "sharegpt", "--dataset-path"]
    args = build_parser().parse_args(["bench", "serve", *flags, str(path), "--num-prompts", "3"])
    assert [r.prompt for r in build_requests(args, tokenizer)] == ["Tell me about the harbour at dawn."] * 3
    args.no_oversample = True
    assert len(build_requests(args, tokenizer)) == 1
    lines = tmp_path / "prompts.jsonl"
    lines.write_text(
        '{"prompt": "a b c", "output_len": 7}\n\n{"prompt": "d", "images": ["data:image/png;base64,x"], '
        f'"videos": ["{tmp_path}/clip.mp4", "http://videos.test/a.mp4"]}}\n'
    )
    first, second = jsonl_requests(str(lines), tokenizer, 10, 5)
    assert (first.output_len, second.output_len, second.images) == (7, 5, ["data:image/png;base64,x"])
    assert second.videos == [(tmp_path / "clip.mp4").as_uri(), "http://videos.test/a.mp4"] and first.videos == []
    lines.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        jsonl_requests(str(lines), tokenizer, 10, 5)


# Bodies as vLLM's `vllm bench serve` client builds them (vllm/benchmarks/lib/endpoint_request_func.py: the
# completions and chat request functions; sampling flags and --extra-body are merged in only when given)
VLLM_COMPLETIONS_BODY = {
    "model": "tiny",
    "prompt": "a b c",
    "repetition_penalty": 1.0,
    "max_tokens": 3,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
}
VLLM_CHAT_BODY = {
    "model": "tiny",
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a b c"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}},
            ],
        }
    ],
    "max_completion_tokens": 3,
    "stream": True,
    "stream_options": {"include_usage": True},
}


class FakeServer:
    """Answers every POST with a two-token SSE stream and a usage chunk, recording the bodies."""

    def __init__(self, prompt_tokens: int | None):
        import http.server
        import threading

        bodies, headers, times = self.bodies, self.headers, self.times = [], [], []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                times.append(time.perf_counter())
                headers.append(dict(self.headers))
                bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                usage = {"completion_tokens": 2, **({"prompt_tokens": prompt_tokens} if prompt_tokens else {})}
                events = [
                    {"choices": [{"index": 0, "text": "x"}]},
                    {"choices": [{"index": 0, "text": "y"}]},
                    {"choices": [], "usage": usage},
                ]
                payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload.encode())

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize("prompt_tokens", [None, 341])
def test_request_bodies_and_input_tokens_as_vllms_client(prompt_tokens):
    import asyncio

    from fovea.bench import serve
    from fovea.bench.datasets import BenchRequest

    fake = FakeServer(prompt_tokens)
    text, image = BenchRequest("a b c", 3, 3), BenchRequest("a b c", 3, 3, ["data:image/png;base64,x"])
    try:
        results, _, _ = asyncio.run(
            serve.run([text], fake.url, "/v1/completions", "tiny", request_rate=float("inf"), progress=False)
        )
        asyncio.run(
            serve.run(
                [image],
                fake.url,
                "/v1/chat/completions",
                "tiny",
                request_rate=float("inf"),
                progress=False,
                ignore_eos=True,
                extra_body={"temperature": 0.0},
            )
        )
    finally:
        fake.server.shutdown()
    assert fake.bodies == [VLLM_COMPLETIONS_BODY, {**VLLM_CHAT_BODY, "ignore_eos": True, "temperature": 0.0}]
    # the server's count (template and image tokens included) when it gives one, else the dataset's
    assert results[0].prompt_len == (prompt_tokens or 3) and results[0].output_tokens == 2


def test_vllm_bench_serve_flags_headers_logprobs_ramp_up_and_readiness(tmp_path):
    """--header, --request-id-prefix (x-request-id PREFIX0, ...), --logprobs in both bodies, a linear ramp-up from
    5 to 40 requests/s (the gaps shrink as the rate grows), the ramp's rules, --served-model-name sent with a
    --model path as the tokenizer, and --ready-check-timeout-sec waiting for an unreachable server."""
    import asyncio

    from fovea.bench import serve
    from fovea.bench.datasets import BenchRequest

    fake = FakeServer(None)
    requests = [BenchRequest(f"p{i}", 1, 2) for i in range(12)]
    try:
        asyncio.run(serve.run(requests, fake.url, "/v1/completions", "tiny", request_rate=float("inf"),
                              progress=False, headers={"X-Team": "vision"}, request_id_prefix="run7-", logprobs=3,
                              ramp_up=("linear", 5, 40), burstiness=1000))  # fmt: skip
        asyncio.run(serve.run(requests[:1], fake.url, "/v1/chat/completions", "tiny", request_rate=float("inf"),
                              progress=False, logprobs=2))  # fmt: skip
    finally:
        fake.server.shutdown()
    assert sorted(h["x-request-id"] for h in fake.headers[:12]) == sorted(f"run7-{i}" for i in range(12))
    assert all(h["X-Team"] == "vision" for h in fake.headers[:12])
    assert {b["logprobs"] for b in fake.bodies[:12]} == {3}
    assert (fake.bodies[12]["logprobs"], fake.bodies[12]["top_logprobs"]) == (True, 2)
    gaps = np.diff(fake.times[:12])  # at near-fixed gaps (burstiness 1000): 1/rate of the next request
    rates = [serve.ramp_rate(i + 1, 12, "linear", 5, 40) for i in range(11)]
    assert np.allclose(gaps, [1 / r for r in rates], atol=0.03), (gaps, rates)
    assert serve.ramp_rate(11, 12, "exponential", 2, 32) == 32 and serve.ramp_rate(0, 12, "exponential", 2, 32) == 2

    common = ["--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"]
    for flags, words in [
        (["--ramp-up-strategy", "linear"], "needs --ramp-up-start-rps and --ramp-up-end-rps"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "9", "--ramp-up-end-rps", "3"], "must be at most"),
        (["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0", "--ramp-up-end-rps", "3"], "above 0"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "3", "--request-rate", "4"],
         "leave out --request-rate"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            bench(*common, *flags)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"could not reach the server at .* in 2 s"):
        bench(*common, "--ready-check-timeout-sec", "2", "--trust-remote-code", "--tokenizer-mode", "auto")
    assert time.monotonic() - start >= 2


def test_vllms_newer_bench_serve_flags(tiny_dirs, tmp_path):
    """vLLM's send schedule (gaps summed and stretched so the last request goes at N/rate; constant gaps at an
    infinite burstiness), --lora-modules in turn or at random, --probe-request-rate's probes and figures, the
    client queue's metrics, random prompts ignoring EOS, --input-len/--output-len, --use-beam-search,
    --append-result, and vLLM flags for what is not here refused by name."""
    import asyncio

    from fovea.bench import serve
    from fovea.bench.datasets import BenchRequest

    rng = np.random.default_rng(0)
    times = serve.send_times(50, 10.0, 1.0, rng)
    assert times[-1] == pytest.approx(5.0) and np.all(np.diff(times) >= 0) and np.std(np.diff(times)) > 0.02
    assert serve.send_times(4, 2.0, float("inf"), rng) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert serve.send_times(3, float("inf"), 1.0, rng) == [0.0, 0.0, 0.0]
    assert serve.lora_names(5, ["a", "b"], "round-robin", rng) == ["a", "b", "a", "b", "a"]
    assert set(serve.lora_names(40, ["a", "b"], "random", rng)) == {"a", "b"}

    fake = FakeServer(None)
    requests = [BenchRequest(f"p{i}", 1, 2) for i in range(6)]
    try:
        results, _, probes = asyncio.run(
            serve.run(requests, fake.url, "/v1/completions", "base", request_rate=float("inf"), progress=False,
                      max_concurrency=1, lora_modules=["x", "y"], lora_assignment="round-robin", probe_rate=50.0)
        )  # fmt: skip
        flags = ["--base-url", fake.url, "--model", "tiny", "--served-model-name", "tiny", "--num-prompts", "2",
                 "--tokenizer", str(tiny_dirs["tiny-3b"]), "--ready-check-timeout-sec", "0", "--input-len", "9",
                 "--output-len", "3", "--use-beam-search", "--append-result", "--result-dir", str(tmp_path),
                 "--result-filename", "runs.jsonl", "--percentile-metrics", "ttft,client_queue_time",
                 "--max-concurrency", "1", "--request-rate", "100"]  # fmt: skip
        first = bench(*flags)
        bench(*flags)  # appended to the same file
    finally:
        fake.server.shutdown()
    main = [b for b in fake.bodies if b["prompt"] != "Hi"]
    assert [b["model"] for b in main[:6]] == ["x", "y"] * 3
    assert probes and all(p.success for p in probes)  # at least the first probe, sent as the run starts
    assert all(b["model"] == "base" and b["max_tokens"] == 1 for b in fake.bodies if b["prompt"] == "Hi")
    # all six arrive at once and wait for the one slot in turn
    assert results[0].queue_time < 0.01 and results[-1].queue_time > results[0].queue_time
    # random prompts ignore EOS and run to --output-len, of --input-len tokens; beam search asked for
    assert all(b["ignore_eos"] and b["max_tokens"] == 3 and b["use_beam_search"] for b in main[6:])
    assert first["total_input_tokens"] == 2 * 9 and "p99_client_queue_time_ms" in first
    assert "p99_e2el_including_client_queue_ms" not in first  # (not asked for in --percentile-metrics)
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert len(lines) == 2 and [json.loads(line)["completed"] for line in lines] == [2, 2]
    from fovea.bench.metrics import probe_metrics

    figures = probe_metrics([RequestResult(1, 1, success=True, latency=0.01 * i) for i in range(1, 11)])
    assert figures["probe_completed"] == 10 and figures["probe_max_e2el_ms"] == pytest.approx(100)
    assert "Median probe E2EL (ms):" in format_table(compute_metrics([], 1.0) | figures, (), ())
    base = ["--base-url", "http://127.0.0.1:9", "--ready-check-timeout-sec", "0", "--num-prompts", "1"]
    for extra, words in [
        (["--self-timed"], "timed_trace"),
        (["--no-self-timed"], "timed_trace"),
        (["--skip-tokenizer-init"], "built and counted with the tokenizer"),
        (["--plot-timeline"], "--plot FILE.png"),
        (["--plot-dataset-stats"], "--plot FILE.png"),
    ]:
        with pytest.raises(ValueError, match=words):
            bench(*base, *extra)
    with pytest.raises(ValueError, match="takes no --dataset-path"):
        bench(*base, "--model", "t", "--tokenizer", str(tiny_dirs["tiny-3b"]), "--dataset-path", "x.json")


def test_vllm_backend_names_and_sampling_flags():
    parse = build_parser().parse_args
    for backend in ("openai", "vllm", "openai-chat"):
        assert parse(["bench", "serve", "--backend", backend]).backend == backend
    args = parse(["bench", "serve", "--backend", "openai", "--endpoint", "/v1/chat/completions"])
    with pytest.raises(ValueError, match="--backend openai speaks to /v1/completions"):
        args.func(args)
    args = parse(["bench", "serve", "--top-k", "5", "--temperature", "0.5"])
    assert (args.top_k, args.temperature, args.top_p) == (5, 0.5, None)


def test_bench_serve_fails_loudly_when_nothing_completes(tiny_dirs, served, tmp_path, monkeypatch):
    """No server, a refused key, or every request failing: a non-zero exit naming why, and no result file. The
    client reads OPENAI_API_KEY (vLLM's bench does), the server VLLM_API_KEY."""
    from fovea.cli import main

    model = str(tiny_dirs["tiny-3b"])
    common = [
        "bench",
        "serve",
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--num-prompts",
        "2",
        "--random-input-len",
        "8",
        "--random-output-len",
        "2",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(tmp_path),
    ]
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="could not reach the server at http://127.0.0.1:"):
        main([*common, "--base-url", f"http://127.0.0.1:{free_port()}", "--ready-check-timeout-sec", "0"])
    base = served
    with pytest.raises(SystemExit, match="answered 401 .give the key with --api-key or OPENAI_API_KEY"):
        main([*common, "--base-url", base])
    with pytest.raises(SystemExit, match=r"no request completed \(2 failed\); the first failure: .*401"):
        main([*common, "--base-url", base, "--model", "fovea-demo"])  # past the model lookup
    assert not list(tmp_path.iterdir())  # nothing written for runs that measured nothing
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    main([*common, "--base-url", base])
    written = json.loads(next(tmp_path.iterdir()).read_text())
    assert written["completed"] == 2 and written["failed"] == 0


def test_pyspy_summary_counts_each_thread_and_leaves_out_the_engines_start_up():
    """benchmarks/pyspy_summary.py (gpu_check.sh mmprofile) on py-spy's raw format: a spawned child's command line
    holds ';', which must not cut its stacks; `within` keeps a thread's samples from its serving loop on, and
    counts the threads that never enter it whole."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from pyspy_summary import summarize

    engine = 'process 7:"python -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=9)"'
    main_thread, encoder = "thread (7): MainThread", "thread (8): fovea-image-encoder"
    lines = [
        f"{engine};{main_thread};run_engine_core (fovea/engine/engine_core.py:60);load_model (loader.py:3) 40",
        f"{engine};{main_thread};run_engine_core (fovea/engine/engine_core.py:80);_serve (engine_core.py:95);"
        "step (engine.py:210);execute (model_runner.py:160) 30",
        f"{engine};{main_thread};run_engine_core (engine_core.py:80);_serve (engine_core.py:92);poll (connection.py:1) 10",
        f"{engine};{encoder};_loop (image_encoder.py:107);_run (image_encoder.py:115) 20",
        'process 5:"fovea serve";thread (5): MainThread;select (selectors.py:9) 50',
    ]
    threads = {e["thread"]: e for e in summarize(lines, within="_serve")["threads"]}
    assert set(threads) == {main_thread, encoder, "thread (5): MainThread"}
    assert threads[main_thread]["process"] == engine
    assert threads[main_thread]["samples"] == 40  # the 40 of loading the model are start-up
    assert dict(threads[main_thread]["functions"])["step (engine.py)"] == 30
    assert dict(threads[main_thread]["leaves"]) == {"execute (model_runner.py)": 30, "poll (connection.py)": 10}
    assert threads[encoder]["samples"] == 20
    assert summarize(lines)["samples"] == 150


def test_the_tests_the_gpu_check_leaves_out_exist():
    """gpu_check.sh's `tests` stage deselects the Ray tests by name (Ray is not on the GPU machine): a test renamed
    since is no longer left out there, and fails on its missing import instead. Each named test is still defined."""
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    named = re.findall(r"--deselect (\S+)", (root / "benchmarks" / "gpu_check.sh").read_text())
    assert len(named) >= 3, named
    for node in named:
        path, name = node.split("::")
        assert f"def {name}(" in (root / path).read_text(), f"{node}: no such test (renamed?)"


def write_parquet(path, rows: list[dict]) -> None:
    import pyarrow
    import pyarrow.parquet

    path.parent.mkdir(parents=True, exist_ok=True)
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)


def png(width: int, height: int, seed: int) -> dict:
    """An image as datasets keeps it in parquet."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buffer, format="PNG"
    )
    return {"bytes": buffer.getvalue(), "path": None}


def test_hf_workloads_read_the_splits_parquet_shards(tiny_dirs, tmp_path, served, monkeypatch):
    """--dataset-name hf on a local copy of a hub dataset (its parquet shards as the hub lays them out): VisionArena
    rows become the first turn's text with the first image (a JPEG data URL of its pixels) and 128 tokens out;
    ShareGPT-form rows their first message, image and reply length, vLLM's filters applied; only the split's
    shards are read, in a seeded order; served through the chat endpoint."""
    from transformers import AutoTokenizer

    from fovea.bench.hf_datasets import hf_requests

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dirs["tiny-3b"]))
    arena = tmp_path / "arena"
    prompts = [f"What is drawn in picture number {i}, and why?" for i in range(6)]
    for shard in range(2):
        rows = [
            {
                "conversation": [[{"role": "user", "content": prompts[i]}, {"role": "assistant", "content": "A cat."}]],
                "images": [png(40 + i, 30 + i, i)],
            }
            for i in range(3 * shard, 3 * shard + 3)
        ]
        write_parquet(arena / "data" / f"train-0000{shard}-of-00002.parquet", rows)
    other = [{"conversation": [[{"role": "user", "content": "not in train"}]], "images": [png(8, 8, 9)]}]
    write_parquet(arena / "data" / "test-00000-of-00001.parquet", other)
    name = "lmarena-ai/VisionArena-Chat"
    requests = hf_requests(str(arena), tokenizer, 6, name=name)
    assert sorted(r.prompt for r in requests) == sorted(prompts)
    for request in requests:
        i = prompts.index(request.prompt)
        assert (request.output_len, request.prompt_len) == (128, len(tokenizer.encode(request.prompt)))
        image = Image.open(io.BytesIO(base64.b64decode(request.images[0].split(",", 1)[1])))
        assert (image.format, image.size) == ("JPEG", (40 + i, 30 + i))
    orders = {tuple(r.prompt for r in hf_requests(str(arena), tokenizer, 6, name=name, seed=seed)) for seed in range(4)}
    assert len(orders) > 1 and [r.prompt for r in requests] == [
        r.prompt for r in hf_requests(str(arena), tokenizer, 6, name=name)
    ]
    assert [r.prompt for r in hf_requests(str(arena), tokenizer, 1, name=name, split="test")] == ["not in train"]
    # streamed, the first three rows come from one shard; --no-stream shuffles the split's rows all together
    shard_of = {p: i // 3 for i, p in enumerate(prompts)}
    for whole in (False, True):
        firsts = [hf_requests(str(arena), tokenizer, 6, name=name, seed=seed, whole=whole) for seed in range(8)]
        assert all(sorted(r.prompt for r in found) == sorted(prompts) for found in firsts)
        mixed = [len({shard_of[r.prompt] for r in found[:3]}) > 1 for found in firsts]
        assert any(mixed) if whole else not any(mixed)
    # a hub id: the dataset's file list, then each shard downloaded as it is reached (two rows: one shard)
    import huggingface_hub

    listed = ["README.md", *(str(p.relative_to(arena)) for p in sorted(arena.rglob("*.parquet")))]
    fetched = []
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo, repo_type: listed)
    monkeypatch.setattr(
        huggingface_hub, "hf_hub_download", lambda repo, file, repo_type: fetched.append(file) or str(arena / file)
    )
    assert len(hf_requests(name, tokenizer, 2)) == 2 and len(fetched) == 1 and fetched[0].startswith("data/train-")
    with pytest.raises(ValueError, match="does not know 'somebody/other'"):
        hf_requests(str(arena), tokenizer, 1, name="somebody/other")
    with pytest.raises(ValueError, match="no parquet files of split 'validation'"):
        hf_requests(str(arena), tokenizer, 1, name=name, split="validation")

    onevision = tmp_path / "onevision.parquet"
    turns = lambda question, reply: [{"from": "human", "value": question}, {"from": "gpt", "value": reply}]  # noqa: E731
    write_parquet(onevision, [
        {"conversations": turns("Hi", "Hello there, friend."), "image": None},  # a prompt under 4 tokens: skipped
        {"conversations": turns("<image>\nWhat colour is the sky here?", "Blue, with clouds."), "image": png(20, 10, 1)},
        {"conversations": turns("Name three rivers of Europe.", "The Rhine, the Danube and the Loire."), "image": None},
    ])  # fmt: skip
    found = hf_requests(str(onevision), tokenizer, 5, name="lmms-lab/LLaVA-OneVision-Data")
    by_prompt = {r.prompt: r for r in found}
    assert set(by_prompt) == {"<image>\nWhat colour is the sky here?", "Name three rivers of Europe."}
    sky = by_prompt["<image>\nWhat colour is the sky here?"]
    assert sky.output_len == len(tokenizer.encode("Blue, with clouds.")) and len(sky.images) == 1
    assert not by_prompt["Name three rivers of Europe."].images
    fixed = hf_requests(str(onevision), tokenizer, 5, name="lmms-lab/LLaVA-OneVision-Data", output_len=9)
    assert {r.output_len for r in fixed} == {9}
    mmstar = tmp_path / "mmstar" / "val" / "0000.parquet"  # (a split's folder)
    question = "Which animal is shown?\nOptions: A: a cat, B: a dog"
    write_parquet(mmstar, [{"index": 0, "question": question, "image": png(24, 16, 2), "answer": "A"}])
    [star] = hf_requests(str(tmp_path / "mmstar"), tokenizer, 3, name="Lin-Chen/MMStar", split="val")
    assert (star.prompt, star.output_len, len(star.images)) == ("Which animal is shown?", 128, 1)

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    flags = ["--base-url", served, "--tokenizer", str(tiny_dirs["tiny-3b"]), "--dataset-name", "hf",
             "--dataset-path", str(arena), "--hf-name", name, "--num-prompts", "3", "--hf-output-len", "4",
             "--ignore-eos"]  # fmt: skip
    result = bench(*flags, "--backend", "openai-chat", "--no-stream")
    assert result["completed"] == 3 and result["failed"] == 0 and result["total_output_tokens"] == 12
    # vLLM's way to name the served model when --model is the checkpoint's path (its tokenizer)
    named = ["--model", str(tiny_dirs["tiny-3b"]), "--served-model-name", "tiny", *flags[4:], "--num-prompts", "1"]
    assert bench("--base-url", served, *named, "--backend", "openai-chat")["model_id"] == "tiny"
    with pytest.raises(ValueError, match="images and videos need --backend openai-chat"):
        bench(*flags)
    model = ["--model", str(tiny_dirs["tiny-3b"]), "--dtype", "float32", "--max-model-len", "1024", *GPU_SHARE_FLAGS]
    offline = build_parser().parse_args(["bench", "throughput", *model, *flags[4:-1]])  # the workload flags
    assert offline.func(offline)["fovea"]["num_requests"] == 3


def test_prefix_repetition_and_custom_workloads(tiny_dirs, tmp_path):
    """vLLM's prefix_repetition (each of N random prefixes under num_prompts // N random suffixes, shuffled) and
    custom (its name for jsonl: --custom-output-len, and the chat template on a completions endpoint unless
    --skip-chat-template)."""
    from transformers import AutoTokenizer

    from fovea.bench.cli import build_requests

    model = str(tiny_dirs["tiny-3b"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    parse = lambda *flags: build_parser().parse_args(["bench", "serve", "--tokenizer", model, *flags])  # noqa: E731
    flags = ["--dataset-name", "prefix_repetition", "--num-prompts", "10", "--prefix-repetition-num-prefixes", "3"]
    flags += ["--prefix-repetition-prefix-len", "30", "--prefix-repetition-suffix-len", "12"]
    requests = build_requests(parse(*flags), tokenizer)
    assert len(requests) == 9 and {r.output_len for r in requests} == {128}
    by_prefix = {}
    for request in requests:
        ids = tokenizer.encode(request.prompt, add_special_tokens=False)
        assert abs(len(ids) - 42) <= 2 and request.prompt_len == len(ids)
        by_prefix.setdefault(tokenizer.decode(ids[:25]), []).append(request)
    assert sorted(len(group) for group in by_prefix.values()) == [3, 3, 3]
    assert [r.prompt for r in requests] != [r.prompt for group in by_prefix.values() for r in group]  # shuffled
    with pytest.raises(ValueError, match="must be at least --prefix-repetition-num-prefixes"):
        build_requests(parse("--dataset-name", "prefix_repetition", "--num-prompts", "2"), tokenizer)
    assert len(build_requests(parse(*flags, "--random-batch-size", "1"), tokenizer)) == 9  # vLLM's default
    with pytest.raises(ValueError, match="--random-batch-size batches prompts for embedding models"):
        build_requests(parse(*flags, "--random-batch-size", "4"), tokenizer)

    rows = tmp_path / "custom.jsonl"
    rows.write_text('{"prompt": "Name a colour."}\n{"prompt": "Count to three.", "output_len": 9}\n')
    custom = ["--dataset-name", "custom", "--dataset-path", str(rows), "--custom-output-len", "20"]
    custom += ["--endpoint", "/v1/chat/completions", "--disable-shuffle"]
    chat = build_requests(parse(*custom, "--num-prompts", "2"), tokenizer)
    assert [(r.prompt, r.output_len) for r in chat] == [("Name a colour.", 20), ("Count to three.", 9)]
    # without --disable-shuffle: shuffled with --seed; fewer rows than prompts: drawn again unless --no-oversample
    orders = {
        tuple(
            r.prompt for r in build_requests(parse(*custom[:-1], "--num-prompts", "2", "--seed", str(seed)), tokenizer)
        )
        for seed in range(6)
    }
    assert orders == {("Name a colour.", "Count to three."), ("Count to three.", "Name a colour.")}
    assert len(build_requests(parse(*custom, "--num-prompts", "5"), tokenizer)) == 5
    assert len(build_requests(parse(*custom, "--num-prompts", "5", "--no-oversample"), tokenizer)) == 2
    custom += ["--endpoint", "/v1/completions", "--num-prompts", "2"]  # (the last --endpoint wins)
    templated = build_requests(parse(*custom), tokenizer)[0]
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=False
    )
    assert templated.prompt == expected and templated.prompt_len == len(tokenizer.encode(expected))
    assert build_requests(parse(*custom, "--skip-chat-template"), tokenizer)[0].prompt == "Name a colour."
