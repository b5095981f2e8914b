"""vLLM launch lines run unchanged: flags that change nothing are accepted and logged, values fovea cannot honour
fail naming what is missing, vLLM's spellings (`--max-model-len 32k`) parse, and the server-side flags
(--generation-config, --max-logprobs, --response-role, --enable-log-requests, --model, --root-path) do what
they do in vLLM."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest
from serving import free_port, running_server

from fovea import LLM, SamplingParams
from fovea.cli import build_parser, parse_args
from fovea.config.engine import EngineConfig
from fovea.config.flags import engine_kwargs
from fovea.config.vllm_args import parse_max_model_len
from fovea.core.sampling_params import default_sampling_params


@pytest.mark.parametrize(
    "text, tokens",
    [
        ("32768", 32768),
        ("32k", 32000),
        ("32K", 32768),
        ("25.6k", 25600),
        ("1m", 10**6),
        ("2M", 2**21),
        ("auto", None),
        ("-1", None),
        (4096, 4096),
        (None, None),
    ],
)
def test_max_model_len_forms(text, tokens):
    assert parse_max_model_len(text) == tokens


@pytest.mark.parametrize("text", ["32q", "1.5", "0.0001k", "", "k"])
def test_max_model_len_nonsense_is_refused(text):
    with pytest.raises(ValueError, match="max_model_len"):
        parse_max_model_len(text)


def test_neutral_values_pass_and_others_name_what_is_missing(tiny_dirs):
    model = tiny_dirs["tiny-3b"]
    config = EngineConfig.from_args(
        str(model),
        pipeline_parallel_size=1,
        kv_cache_dtype="auto",
        load_format="auto",
        enable_chunked_prefill=False,
        trust_remote_code=True,
        tokenizer=str(model),
        max_model_len="1K",
        swap_space=4,
        mm_processor_cache_gb=0,
        disable_cascade_attn=True,
        cuda_graph_sizes=[1, 2, 4],
        enable_expert_parallel=True,
        guided_decoding_backend="xgrammar",
        stream_interval=4,
        enable_sleep_mode=False,
        logprobs_mode="raw_logprobs",
        speculative_config=None,
    )
    assert config.max_model_len == 1024
    for args, words in [
        (dict(pipeline_parallel_size=2), "pipeline parallelism is not implemented"),
        (dict(ec_transfer_config='{"ec_role": "ec_consumer"}'), "--mm-encoder-workers N runs the vision tower"),
        (dict(kv_cache_dtype="fp8_e5m2"), "fp8_e5m2 is not"),
        (dict(quantization="awq"), "the checkpoint is not quantized"),
        (dict(load_format="pt"), "only safetensors"),
        (dict(tokenizer=str(tiny_dirs["tiny-7b"])), "a tokenizer other than the model's own"),
        (dict(generation_config="/no/such/dir"), "generation_config must be auto, vllm or"),
        (dict(scheduling_policy="lottery"), "scheduling_policy must be one of fcfs, priority; got 'lottery'"),
        (dict(attention_backend="flash"), "attention_backend must be one of auto, torch, triton"),
        (dict(distributed_executor_backend="uni"), "distributed_executor_backend must be one of mp, ray; got 'uni'"),
        (dict(model_impl="transformers"), "fovea runs its own model code"),
        (dict(speculative_config={"method": "ngram"}), "speculative decoding is not implemented"),
        (dict(enable_sleep_mode=True), "sleep mode is not implemented"),
        (dict(logprobs_mode="processed"), "logprobs_mode must be one of raw_logprobs"),
        (dict(kv_transfer_config={"kv_connector": "x"}), "disaggregated prefill"),
        (dict(stream_interval=0), "stream_interval must be at least 1, got 0"),
    ]:
        with pytest.raises(ValueError, match=words):
            EngineConfig.from_args(str(model), **args)
    with pytest.raises(TypeError, match="unexpected engine arguments"):
        EngineConfig.from_args(str(model), no_such_argument=1)


def test_mm_limits_take_vllms_counts_with_profile_sizes(tiny_dirs, fovea_log):
    """vLLM's {"count": N, "width": ..., "height": ...} per modality is its count here (the sizes only shape
    vLLM's profile, logged as ignored); a dict without a count, or a modality left out, keeps fovea's bound; a
    count that is not one, or a modality fovea does not serve, is refused before the model loads."""
    model = str(tiny_dirs["tiny-3b"])
    limits = {"image": {"count": 3, "width": 512, "height": 512}, "video": {"num_frames": 32}}
    assert EngineConfig.from_args(model, limit_mm_per_prompt=limits).limit_mm_per_prompt == {"image": 3, "video": 2}
    assert "accepted and ignored limit_mm_per_prompt['image'] {'width': 512, 'height': 512}" in fovea_log.text
    assert EngineConfig.from_args(model, limit_mm_per_prompt={"video": 0}).limit_mm_per_prompt == {
        "image": 16,
        "video": 0,
    }
    for given, why in (
        ({"image": "four"}, r"limit_mm_per_prompt\['image'\] must be a count of 0 or more, got 'four'"),
        ({"image": -1}, "must be a count of 0 or more, got -1"),
        ({"image": {"count": True}}, "must be a count of 0 or more, got True"),
        ({"audio": 1}, "'audio' is not a modality fovea serves"),
        ({"video": {"count": 1, "length": 3}}, r"takes count and height, num_frames, width, not \['length'\]"),
        ([1, 2], "must be a JSON object"),
    ):
        with pytest.raises(ValueError, match=why):
            EngineConfig.from_args(model, limit_mm_per_prompt=given)


def test_generation_config_auto_vllm_or_a_directory(tiny_dirs, tmp_path):
    model = tiny_dirs["tiny-3b"]
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.5, "top_k": 7}')
    auto = default_sampling_params(model, "auto")
    assert (auto.temperature, auto.top_k, auto.repetition_penalty) == (0.1, 1, 1.05)  # what `fovea tiny` writes
    assert default_sampling_params(model, "vllm") == SamplingParams()
    other = default_sampling_params(model, str(tmp_path))
    assert (other.temperature, other.top_k, other.repetition_penalty) == (0.5, 7, 1.0)
    # vLLM's --override-generation-config: over the chosen defaults (also over none), its max_new_tokens ours
    over = default_sampling_params(model, "auto", {"temperature": 0.3, "max_new_tokens": 7})
    assert (over.temperature, over.top_k, over.repetition_penalty, over.max_tokens) == (0.3, 1, 1.05, 7)
    assert default_sampling_params(model, "vllm", {"top_p": 0.5}) == SamplingParams(top_p=0.5)
    with pytest.raises(ValueError, match="temperature must be in"):
        default_sampling_params(model, "auto", {"temperature": -1})
    llm_args = build_parser().parse_args(["serve", str(model), "--override-generation-config", '{"top_k": 3}'])
    assert engine_kwargs(llm_args)["override_generation_config"] == {"top_k": 3}


def test_max_logprobs_bounds_requests(tiny_dirs):
    llm = LLM(str(tiny_dirs["tiny-3b"]), max_model_len=256, max_logprobs=3)
    assert (
        len(llm.generate("hi", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)[0].outputs[0].logprobs[0]) >= 3
    )
    with pytest.raises(ValueError, match="logprobs=4 is more than max_logprobs=3"):
        llm.generate("hi", SamplingParams(max_tokens=2, logprobs=4), use_tqdm=False)


def test_a_vllm_launch_line_serves(tiny_dirs, tmp_path):
    model = str(tiny_dirs["tiny-3b"])
    config = tmp_path / "serve.yaml"  # vLLM's --config: some of the flags from a file
    config.write_text("response-role: bot\nmax_logprobs: 2\nmax-model-len: 1k\n")
    flags = [
        "--model",
        model,
        "--config",
        str(config),
        "--served-model-name",
        "first",
        "second",
        "-pp",
        "1",
        "--kv-cache-dtype",
        "auto",
        "--load-format",
        "auto",
        "--generation-config",
        "vllm",
        "--enable-log-requests",
        "--tokenizer",
        model,
        "--root-path",
        "/proxied",
        "--no-enable-chunked-prefill",
        "--trust-remote-code",
        "--disable-log-stats",
        "--mm-processor-workers",
        "0",
        "--uvicorn-log-level",
        "info",
        "--enable-force-include-usage",
        "--return-tokens-as-token-ids",
        "--enable-request-id-headers",
        "--disable-fastapi-docs",
        "--disable-uvicorn-access-log",
        "--scheduling-policy",
        "fcfs",
        "--model-impl",
        "auto",
        "--prefix-caching-hash-algo",
        "sha256",
        "--enable-prompt-tokens-details",
        "--enable-server-load-tracking",
        "--max-log-len",
        "60",
        "--disable-cascade-attn",
        "--max-cudagraph-capture-size",
        "64",
        "--enable-expert-parallel",
        "--guided-decoding-backend",
        "xgrammar",
        "-asc",
        "1",
        "--stream-interval",
        "2",
        "--no-enable-sleep-mode",
        "--logprobs-mode",
        "raw_logprobs",
        "--swap-space",
        "4",
        "-O",
        "3",
        "--skip-mm-profiling",
        "--enable-log-outputs",
        "--limit-mm-per-prompt.image",  # vLLM's keys of a JSON flag one at a time
        "1",
        "--limit-mm-per-prompt.video=0",
        "--structured-outputs-config.backend",
        "xgrammar",
        "--task",
        "generate",
        "--safetensors-load-strategy",
        "lazy",
        "--h11-max-incomplete-event-size",
        "65536",
        # vLLM's newer front-end flags that change nothing here, or only at these values
        "--no-enable-log-deltas",
        "--log-error-stack",
        "--fingerprint-mode",
        "none",
        "--h11-max-header-count",
        "256",
        "--cohere-format",
        "cmd4",
        "--disable-access-log-for-endpoints",
        "/health,/metrics",
        "--ssl-ciphers",
        "TLSv1",
    ]
    with running_server(None, *flags) as (base, proc):
        assert httpx.get(base + "/load").json() == {"server_load": 0}
        body = {"model": "first", "prompt": "hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as streamed:
            lines = streamed.iter_lines()  # (kept: an iterator dropped closes the stream, and the request goes)
            assert next(lines).startswith("data: ")  # under way
            assert httpx.get(base + "/load").json() == {"server_load": 1}
        deadline = time.monotonic() + 30  # the client left: its request is aborted
        while httpx.get(base + "/load").json() != {"server_load": 0}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert [httpx.get(base + path).status_code for path in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
        given = httpx.get(base + "/v1/models", headers={"x-request-id": "trace-7"}).headers["x-request-id"]
        made = httpx.get(base + "/v1/models").headers["x-request-id"]
        assert given == "trace-7" and len(made) == 32
        scored = {"model": "first", "prompt": "hi", "max_tokens": 2, "logprobs": 1}
        as_ids = httpx.post(base + "/v1/completions", json=scored).json()["choices"][0]["logprobs"]["tokens"]
        scored["return_tokens_as_token_ids"] = False  # the request's own choice wins
        as_text = httpx.post(base + "/v1/completions", json=scored).json()["choices"][0]["logprobs"]["tokens"]
        assert all(t.startswith("token_id:") for t in as_ids) and not any(t.startswith("token_id:") for t in as_text)
        # load balancers' and SageMaker's probe; every stream carries its usage, asked for or not
        assert [httpx.request(method, base + "/ping").status_code for method in ("GET", "POST")] == [200, 200]
        body = {"model": "first", "prompt": "hi", "max_tokens": 3, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as streamed:
            events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
        assert all("usage" in event for event in events), events
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
        # on a loopback address: a page that rebound its name here, a foreign page, a text/plain body are refused
        rebound = httpx.get(base + "/health", headers={"host": "rebound.example:8000"})
        foreign = httpx.get(base + "/v1/models", headers={"origin": "https://evil.example"})
        form = httpx.post(base + "/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
        assert (rebound.status_code, foreign.status_code, form.status_code) == (403, 403, 415)
        models = httpx.get(base + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["first", "second"] and models[0]["max_model_len"] == 1000
        reply = httpx.post(
            base + "/v1/chat/completions",
            json={"model": "second", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "bot"
        pixel = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
        two = [{"type": "image_url", "image_url": {"url": pixel}}] * 2
        refused = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": two}]})
        assert refused.status_code == 400 and "limit_mm_per_prompt allows 1" in refused.text
        ranked = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 3})
        assert ranked.status_code == 400 and "needs --scheduling-policy priority" in ranked.text  # fcfs here
        too_many = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 3})
        assert too_many.status_code == 400 and "max_logprobs=2" in too_many.json()["error"]["message"]
        samples = dict(
            line.rsplit(" ", 1)
            for line in httpx.get(base + "/metrics").text.splitlines()
            if line and not line.startswith("#")
        )
    ours = {name: value for name, value in samples.items() if name.startswith("fovea:")}
    assert ours and {name.replace("fovea:", "vllm:", 1): value for name, value in ours.items()} == {
        name: value for name, value in samples.items() if name.startswith("vllm:")
    }
    assert 'vllm:num_requests_running{model_name="first"}' in samples  # dashboards made for vLLM find theirs
    request_id = reply.json()["id"]
    (logged,) = [line for line in proc.output.splitlines() if f"request {request_id}: " in line]
    assert len(logged.split(" prompt tokens, ", 1)[1]) == 60  # --max-log-len: its parameters cut there
    assert (
        f"request {request_id}: " in proc.output
        and "sampling defaults for fields a request leaves out: none (--generation-config vllm)" in proc.output
    )
    assert "accepted and ignored enable_chunked_prefill=False" in proc.output
    assert "accepted and ignored prefix_caching_hash_algo='sha256'" in proc.output
    assert "accepted and ignored disable_cascade_attn=True" in proc.output
    assert "accepted and ignored safetensors_load_strategy='lazy'" in proc.output
    assert 'accepted and ignored structured_outputs_config=\'{"backend": "xgrammar"}\'' in proc.output
    assert "accepted and ignored cuda_graph_sizes" not in proc.output  # not given
    # --enable-log-outputs: a finished request's whole text (the 3 tokens streamed above), in its log line
    assert re.search(r"request cmpl-[\w-]+ output 0 \(length\): '", proc.output), proc.output[-3000:]
    assert "HTTP/1.1" not in proc.output  # no access log, though the log level is info


def test_vllms_newer_front_end_flags_parse_and_refuse_by_name():
    """The 17 of vLLM's front-end flags that did not parse: each parses; those fovea does not have fail naming
    what is missing, at any value but the one that changes nothing; the access log leaves out the paths given
    (--uds and --log-config-file: test_a_server_on_a_unix_socket_with_a_logging_configuration)."""
    import logging

    from fovea.config.vllm_args import take_vllm_args
    from fovea.server.cli import QuietPaths

    parse = build_parser().parse_args
    given = [["--log-config-file", "l.json"], ["--enable-per-request-metrics"], ["--enable-tokenizer-info-endpoint"],
             ["--no-enable-log-deltas"], ["--log-error-stack"], ["--tokens-only"], ["--fingerprint-mode", "hash"],
             ["--fingerprint-value", "x"], ["--data-parallel-supervisor-port", "9256"], ["--uds", "/tmp/s"],
             ["--disable-access-log-for-endpoints", "/health"], ["--enable-ssl-refresh"], ["--ssl-ciphers", "x"],
             ["--h11-max-header-count", "10"], ["--enable-offline-docs"], ["--cohere-format", "cmd3"]]  # fmt: skip
    for flags in given:
        parse(["serve", "m", *flags])
    for name, value, words in [
        ("enable_ssl_refresh", True, "reloading changed certificate files"),
        ("h11_max_header_count", 10, "bounded by size"),
        ("tokens_only", True, "tokens-only"),
        ("fingerprint_mode", "full", "no system_fingerprint"),
        ("enable_per_request_metrics", True, "per-request timings"),
        ("enable_offline_docs", True, "docs pages"),
    ]:
        with pytest.raises(ValueError, match=words):
            take_vllm_args({name: value})
    assert take_vllm_args({"h11_max_header_count": 256, "fingerprint_mode": "none", "log_error_stack": True}) == {}
    quiet = QuietPaths(["/health", "/metrics"])

    def line(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:5", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)

    assert [quiet.filter(line(p)) for p in ("/health", "/metrics?x=1", "/v1/models")] == [False, False, True]


def test_a_server_on_a_unix_socket_with_a_logging_configuration(tmp_path):
    """vLLM's --uds (the server answers on a Unix socket, removed when it stops) and --log-config-file (a
    dictConfig JSON: fovea's log goes where it says, uvicorn's too)."""
    path, log = tmp_path / "fovea.sock", tmp_path / "fovea.log"
    handler = {"class": "logging.FileHandler", "filename": str(log), "formatter": "plain"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(name)s %(levelname)s %(message)s"}},
        "handlers": {"file": handler},
        "loggers": {name: {"handlers": ["file"], "level": "INFO", "propagate": False} for name in ("fovea", "uvicorn")},
    }
    (tmp_path / "logging.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "fovea.cli", "serve", "--uds", str(path), "--log-config-file",
               str(tmp_path / "logging.json"), "--max-model-len", "512", "--mm-processor-workers", "0"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost", timeout=60)
        deadline = time.monotonic() + 120
        while True:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, server.stdout.read() if server.poll() else ""
            time.sleep(0.5)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert client.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 3
    finally:
        server.terminate()
        output = server.communicate(timeout=60)[0]
    assert server.returncode == 0, output[-2000:]
    assert not path.exists()  # removed when the server stopped
    written = log.read_text()
    assert "fovea INFO KV cache:" in written and "KV cache" not in output, written[-2000:]
    (tmp_path / "bad.json").write_text("{not json")
    done, _ = fovea_serve("--uds", str(path), "--log-config-file", str(tmp_path / "bad.json"))
    assert done.returncode != 0 and "--log-config-file" in done.stderr and "Traceback" not in done.stderr


def fovea_serve(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "fovea.cli", "serve", *args], capture_output=True, text=True, timeout=timeout
    )
    return done, time.monotonic() - start


def test_a_config_file_gives_defaults_the_command_line_overrides(tmp_path, capsys):
    """vLLM's `--config FILE`: YAML keys are serve's flags (dashes or underscores), the model too; typed as on the
    command line (lists of LoRA modules, sizes like 32k, JSON objects as mappings); flags given win; a key that is
    no flag fails naming it."""
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: /models/a\nport: 9000\nmax-model-len: 32k\nlimit_mm_per_prompt: {image: 3}\n"
        "enable-prefix-caching: false\nlora-modules: [sql=/adapters/sql, {name: b, path: /adapters/b}]\n"
    )
    args = parse_args(build_parser(), ["serve", "--config", str(config), "--port", "9100"])
    engine = engine_kwargs(args)
    assert (args.model, args.port, engine["max_model_len"], engine["limit_mm_per_prompt"]) == (
        "/models/a",
        9100,
        32000,
        {"image": 3},
    )
    assert engine["enable_prefix_caching"] is False
    assert [(m.name, m.path) for m in args.lora_modules] == [("sql", "/adapters/sql"), ("b", "/adapters/b")]
    assert parse_args(build_parser(), ["serve", "/models/b", "--config", str(config)]).model == "/models/b"
    config.write_text("max-model-len: 1k\nmax-modle-len: 2k\n")
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["serve", "--config", str(config)])
    assert "['max-modle-len'] are not flags of fovea serve" in capsys.readouterr().err


def test_refusals_come_before_the_model_loads(tiny_dirs):
    model = str(tiny_dirs["tiny-3b"])
    done, _ = fovea_serve(model, "--pipeline-parallel-size", "2")
    assert done.returncode != 0 and "pipeline parallelism is not implemented" in done.stderr
    done, _ = fovea_serve(model, "--gpu-memory-utilization", "1.5")  # vLLM refuses more than all of it too
    assert done.returncode != 0 and "gpu_memory_utilization must be in (0, 1], got 1.5" in done.stderr
    done, _ = fovea_serve(model, "--override-generation-config", '{"temprature": 0.5}')
    assert done.returncode != 0 and "['temprature'] are not sampling defaults" in done.stderr
    done, _ = fovea_serve(model, "--enable-sleep-mode")
    assert done.returncode != 0 and "sleep mode is not implemented" in done.stderr
    done, _ = fovea_serve(model, "--task", "embed")
    assert done.returncode != 0 and "task='embed': fovea serves text generation only" in done.stderr
    done, _ = fovea_serve(model, "--enable-log-outputs")
    assert done.returncode != 0 and "--enable-log-outputs requires --enable-log-requests" in done.stderr
    done, _ = fovea_serve(model, "--default-chat-template-kwargs", '{"tools": []}')
    assert done.returncode != 0 and "--default-chat-template-kwargs may not set ['tools']" in done.stderr
    assert "KV cache" not in done.stderr
    assert "Traceback" not in done.stderr
    with socket.socket() as busy:
        port = free_port()
        busy.bind(("127.0.0.1", port))
        busy.listen()
        done, _ = fovea_serve(model, "--port", str(port))
    assert done.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "KV cache" not in done.stderr  # the engine never started


def test_unknown_flags_show_the_subcommands_usage():
    done, _ = fovea_serve("--no-such-flag", "3")
    assert done.returncode == 2 and "usage: fovea serve" in done.stderr
    assert "fovea serve: error: unrecognized arguments: --no-such-flag" in done.stderr


def test_serve_help_shows_every_default():
    import re

    from fovea.cli import build_parser

    text = build_parser().subcommands["serve"].format_help().split("options:", 1)[1]  # past the usage lines
    for flag, default in (
        ("--host HOST", "127.0.0.1"),
        ("--port PORT", "8000"),
        ("--dtype", "auto"),
        ("--max-num-seqs MAX_NUM_SEQS", "256"),
        ("--max-num-batched-tokens", "8192"),
        ("--gpu-memory-utilization", "0.9"),
        ("--seed SEED", "0"),
        ("--api-key", "none"),
        ("--enable-prefix-caching", "True"),
    ):
        entry = text[text.index(flag) :]
        assert f"(default: {default})" in " ".join(entry[: entry.index("\n  -", 1)].split()), flag
    entries = re.split(r"\n(?=  -)", text)
    switches = (
        "-h, --help",
        "--trust",
        "--disable",
        "--enable-log",
        "--enable-auto",
        "--enable-force",
        "--enable-request-id",
        "--enable-prompt-tokens",
        "--enable-server-load",
        "--return-tokens",
        "--enforce",
        "--skip",
        "--fp32",
        "--enable-chunked",
        "--enable-expert",
        "--enable-sleep",
        "--interleave-mm",
        "--exclude-tools",
        "--allow-credentials",
        "--calculate-kv-scales",
        "--enable-dbo",
        "--headless",
        "--mm-encoder-only",
        "--enable-offline-docs",
        "--enable-ssl-refresh",
        "--tokens-only",
        "--enable-tokenizer-info",
        "--enable-per-request",
        "--log-error-stack",
    )
    for entry in entries:
        if entry.strip() and not entry.strip().startswith(switches):
            assert "default" in entry, entry


def test_the_vllm_module_entry_point_serves(tiny_dirs):
    """`python -m fovea.entrypoints.openai.api_server --model M` (vLLM's older form), with seed 002's
    --mm-processor-cache-gb 0; the address is logged at start."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fovea.entrypoints.openai.api_server",
            "--model",
            str(tiny_dirs["tiny-3b"]),
            "--port",
            str(port),
            "--max-model-len",
            "512",
            "--mm-processor-cache-gb",
            "0",
            "--served-model-name",
            "m",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert [m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]] == ["m"]
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0]
    assert f"listening on 127.0.0.1:{port} (this machine only; --host 0.0.0.0 serves others)" in output


def test_vllm_skip_warmup_variable_means_skip_warmup(tiny_dirs, monkeypatch):
    """Seed 000's launch line sets VLLM_SKIP_WARMUP=true."""
    from fovea.cli import build_parser
    from fovea.config.engine import EngineConfig
    from fovea.config.flags import engine_kwargs

    model = str(tiny_dirs["tiny-3b"])
    served = engine_kwargs(build_parser().parse_args(["serve", model]))
    assert not EngineConfig.from_args(model, **served).skip_warmup
    monkeypatch.setenv("VLLM_SKIP_WARMUP", "true")
    assert EngineConfig.from_args(model, **served).skip_warmup and EngineConfig.from_args(model).skip_warmup


@pytest.mark.parametrize(
    "env, level, handlers",
    [
        ({}, "INFO", 1),
        ({"VLLM_LOGGING_LEVEL": "debug"}, "DEBUG", 1),  # vLLM's variable
        ({"FOVEA_LOGGING_LEVEL": "error", "VLLM_LOGGING_LEVEL": "debug"}, "ERROR", 1),  # fovea's first
        ({"VLLM_CONFIGURE_LOGGING": "0"}, "NOTSET", 0),  # left to the application (the root logger's)
        ({"VLLM_LOGGING_LEVEL": "loud"}, "VLLM_LOGGING_LEVEL='loud' is not a level", None),
    ],
)
def test_vllm_logging_variables(env, level, handlers):
    import os

    probe = (
        "import fovea, logging; l = logging.getLogger('fovea'); print(logging.getLevelName(l.level), len(l.handlers))"
    )
    clean = {k: v for k, v in os.environ.items() if "LOGGING" not in k}
    run = subprocess.run([sys.executable, "-c", probe], env=clean | env, capture_output=True, text=True, timeout=60)
    if handlers is None:
        assert run.returncode != 0 and level in run.stderr
    else:
        assert run.stdout.split() == [level, str(handlers)], run.stderr
