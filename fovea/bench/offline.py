"""`fovea bench throughput` and `fovea bench latency`: offline, in-process, as vLLM's offline benchmarks.

throughput: one workload (any of bench serve's datasets, EOS ignored) run by fovea's `LLM.chat` (each prompt a
single-turn chat: backends fovea and vllm-chat), `LLM.generate` (the prompt as it is: vllm) or transformers'
`generate` on padded batches; --compare runs two on the same prompts in one process and prints the ratio. Image
preprocessing is inside the timed run on every side.
latency: end-to-end time of generating one batch of identical-length prompts, over --num-iters runs.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import numpy as np
import torch

from fovea.bench.datasets import BenchRequest
from fovea.multimodal.image import load_image

IMAGE_PAD = "<|image_pad|>"


def conversation(request: BenchRequest) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in request.images]
    content += [{"type": "video_url", "video_url": {"url": url}} for url in request.videos]
    return [{"role": "user", "content": content + [{"type": "text", "text": request.prompt}]}]


def bench_params(output_len: int, n: int = 1, beam_search: bool = False, detokenize: bool = True):
    """Greedy (vLLM's offline benchmarks sample at temperature 1; greedy lets --compare check every token against
    transformers'); n > 1 samples at temperature 1; or a beam search of n beams."""
    from fovea import SamplingParams

    common = dict(n=n, max_tokens=output_len, ignore_eos=True, detokenize=detokenize)
    if beam_search:
        return SamplingParams(use_beam_search=True, temperature=0, **common)
    return SamplingParams(temperature=0 if n == 1 else 1.0, **common)


@dataclass
class OfflineRun:
    """How the offline benchmarks run fovea: whether outputs are detokenized, the adapter requests draw from (as
    vLLM's --lora-path: one of max_loras ids each, at random) and whether the torch profiler records the timed run."""

    detokenize: bool = True
    lora_path: str | None = None
    profile: bool = False
    seed: int = 0


def fovea_runner(
    model: str,
    engine_args: dict,
    n: int = 1,
    beam_search: bool = False,
    how: OfflineRun = OfflineRun(),
    chat: bool = True,
):
    """A function that runs a workload once, each prompt as a chat or (`chat` False) as it is, and returns every
    sample's generated token ids, request by request, and the prompts' lengths in tokens (the chat template's and
    image tokens counted). Benchmarks that repeat give
    each run fresh prompts: the same ones again would find their KV blocks and image embeddings cached, which
    transformers cannot do."""
    from fovea import LLM, LoRARequest

    llm = LLM(model, **engine_args)
    rng = np.random.default_rng(how.seed)

    def run(requests: list[BenchRequest], profile: bool = False) -> tuple[list[list[int]], int]:
        params = [bench_params(r.output_len, n, beam_search, how.detokenize) for r in requests]
        adapters = None
        if how.lora_path:
            ids = rng.integers(1, engine_args.get("max_loras", 1) + 1, size=len(requests)).tolist()
            adapters = [LoRARequest(str(i), i, how.lora_path) for i in ids]
        if profile:
            llm.start_profile()
        if chat:
            outputs = llm.chat([conversation(r) for r in requests], params, use_tqdm=False, lora_request=adapters)
        elif any(r.images or r.videos for r in requests):
            raise ValueError("images and videos need a chat backend (vllm-chat or fovea), not --backend vllm")
        else:
            outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False, lora_request=adapters)
        if profile:
            llm.stop_profile()
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return [list(sample.token_ids) for o in outputs for sample in o.outputs], prompt_tokens

    run([BenchRequest("warm up", 0, 2)])
    return lambda requests: run(requests, how.profile)


def hf_runner(model: str, dtype: str, max_batch: int | None = None):
    """transformers' generate on left-padded batches of at most `max_batch` requests (one batch if None; the
    function `fovea_runner` gives, for the same requests); every request must want the same output length."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    processor = Qwen2VLImageProcessorPil.from_pretrained(model)
    torch_dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, dtype=torch_dtype).to(device).eval()
    image_token = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    hf.generation_config = GenerationConfig(do_sample=False, pad_token_id=tokenizer.pad_token_id or 151643)

    def run(requests: list[BenchRequest]) -> tuple[list[list[int]], int]:
        size = max_batch or len(requests) or 1
        batches = [run_batch(requests[i : i + size]) for i in range(0, len(requests), size)]
        return [ids for outputs, _ in batches for ids in outputs], sum(tokens for _, tokens in batches)

    @torch.no_grad()
    def run_batch(requests: list[BenchRequest]) -> tuple[list[list[int]], int]:
        lengths = {r.output_len for r in requests}
        if any(r.videos for r in requests):
            raise ValueError("the hf backend runs images only; videos need --backend fovea")
        if len(lengths) != 1:
            raise ValueError("the hf backend needs one output length for all requests (--random-range-ratio 0)")
        templated = [
            tokenizer.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": [{"type": "image"}] * len(r.images) + [{"type": "text", "text": r.prompt}],
                    }
                ],
                tokenize=False,
                add_generation_prompt=True,
            )
            for r in requests
        ]
        urls = [url for r in requests for url in r.images]
        texts, extra = templated, {}
        if urls:
            features = processor(images=[load_image(u) for u in urls], return_tensors="pt")
            counts = iter((features["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist())
            # one placeholder per image in the template; the model wants one per image token
            texts = [re.sub(re.escape(IMAGE_PAD), lambda _: IMAGE_PAD * next(counts), t) for t in templated]
            extra = {
                "pixel_values": features["pixel_values"].to(device, hf.dtype),
                "image_grid_thw": features["image_grid_thw"].to(device),
            }
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        batch["mm_token_type_ids"] = (batch["input_ids"] == image_token).long()
        new_tokens = lengths.pop()
        out = hf.generate(**batch, **extra, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        return out[:, batch["input_ids"].shape[1] :].tolist(), int(batch["attention_mask"].sum())

    return run


def throughput(
    model: str,
    requests: list[BenchRequest],
    backend: str,
    engine_args: dict,
    n: int = 1,
    beam_search: bool = False,
    how: OfflineRun = OfflineRun(),
    hf_max_batch: int | None = None,
) -> dict:
    """One backend's run of the workload: vLLM's figures (prompt tokens as the engine counts them, template and
    image tokens included) and every sample's token ids."""
    if backend != "hf":
        run = fovea_runner(model, engine_args, n, beam_search, how, chat=backend != "vllm")
    elif n > 1 or beam_search or how.lora_path or how.profile:
        raise ValueError("--n above 1, --use-beam-search, --lora-path and --profile run on fovea's backends only")
    else:
        run = hf_runner(model, engine_args.get("dtype", "auto"), hf_max_batch)
    start = time.perf_counter()
    outputs, prompt_tokens = run(requests)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o) for o in outputs)
    return {
        "backend": backend,
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": prompt_tokens + output_tokens,
        "output_tokens": output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "outputs": outputs,
    }


def latency(
    model: str,
    input_len: int,
    output_len: int,
    batch_size: int,
    num_iters: int,
    num_iters_warmup: int,
    engine_args: dict,
    n: int = 1,
    beam_search: bool = False,
    how: OfflineRun = OfflineRun(),
) -> dict:
    """`how`: detokenize or not; profile: one more run under the torch profiler, after the timed ones (as vLLM's
    --profile, whose run is not timed)."""
    from fovea import LLM

    llm = LLM(model, **engine_args)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 10000, size=input_len).tolist()} for _ in range(batch_size)]
    params = bench_params(output_len, n, beam_search, how.detokenize)
    for _ in range(num_iters_warmup):
        llm.generate(prompts, params, use_tqdm=False)
    latencies = []
    for _ in range(num_iters):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    if how.profile:
        llm.start_profile()
        llm.generate(prompts, params, use_tqdm=False)
        llm.stop_profile()
    percentiles = {str(p): float(np.percentile(latencies, p)) for p in (10, 25, 50, 75, 90, 99)}
    return {"avg_latency": float(np.mean(latencies)), "latencies": latencies, "percentiles": percentiles}
