"""`fovea bench throughput` and `fovea bench latency`: offline, in-process, as vLLM's offline benchmarks.

throughput: one workload (any of bench serve's datasets, each prompt a single-turn chat, EOS ignored)
run by fovea's `LLM.chat` or by transformers' `generate` on one padded batch; --compare runs both on the same
prompts in one process and prints the ratio. Image preprocessing is inside the timed run on both sides.
latency: end-to-end time of generating one batch of identical-length prompts, over --num-iters runs.
"""

from __future__ import annotations

import re
import time

import numpy as np
import torch

from fovea.bench.datasets import BenchRequest
from fovea.multimodal.image import load_image

IMAGE_PAD = "<|image_pad|>"


def conversation(request: BenchRequest) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in request.images]
    content += [{"type": "video_url", "video_url": {"url": url}} for url in request.videos]
    return [{"role": "user", "content": content + [{"type": "text", "text": request.prompt}]}]


def bench_params(output_len: int, n: int = 1, beam_search: bool = False):
    """vLLM's offline benchmarks' sampling: greedy; n > 1 samples at temperature 1; or a beam search of n beams."""
    from fovea import SamplingParams

    if beam_search:
        return SamplingParams(n=n, use_beam_search=True, temperature=0, max_tokens=output_len, ignore_eos=True)
    return SamplingParams(n=n, temperature=0 if n == 1 else 1.0, max_tokens=output_len, ignore_eos=True)


def fovea_runner(model: str, engine_args: dict, n: int = 1, beam_search: bool = False):
    """A function that runs a workload once and returns every sample's generated token ids, request by request.
    Benchmarks that repeat give each run fresh prompts: the same ones again would find their KV blocks and image
    embeddings cached, which transformers cannot do."""
    from fovea import LLM

    llm = LLM(model, **engine_args)

    def run(requests: list[BenchRequest]) -> list[list[int]]:
        params = [bench_params(r.output_len, n, beam_search) for r in requests]
        outputs = llm.chat([conversation(r) for r in requests], params, use_tqdm=False)
        return [list(sample.token_ids) for o in outputs for sample in o.outputs]

    run([BenchRequest("warm up", 0, 2)])
    return run


def hf_runner(model: str, dtype: str):
    """transformers' generate on one left-padded batch (the function `fovea_runner` gives, for the same requests);
    every request must want the same output length."""
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

    @torch.no_grad()
    def run(requests: list[BenchRequest]) -> list[list[int]]:
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
        return out[:, batch["input_ids"].shape[1] :].tolist()

    return run


def throughput(
    model: str, requests: list[BenchRequest], backend: str, engine_args: dict, n: int = 1, beam_search: bool = False
) -> dict:
    if backend == "fovea":
        run = fovea_runner(model, engine_args, n, beam_search)
    elif n > 1 or beam_search:
        raise ValueError("--n above 1 and --use-beam-search run on the fovea backend only")
    else:
        run = hf_runner(model, engine_args.get("dtype", "auto"))
    start = time.perf_counter()
    outputs = run(requests)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o) for o in outputs)
    prompt_tokens = sum(r.prompt_len for r in requests)
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
) -> dict:
    from fovea import LLM

    llm = LLM(model, **engine_args)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 10000, size=input_len).tolist()} for _ in range(batch_size)]
    params = bench_params(output_len, n, beam_search)
    for _ in range(num_iters_warmup):
        llm.generate(prompts, params, use_tqdm=False)
    latencies = []
    for _ in range(num_iters):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    percentiles = {str(p): float(np.percentile(latencies, p)) for p in (10, 25, 50, 75, 90, 99)}
    return {"avg_latency": float(np.mean(latencies)), "latencies": latencies, "percentiles": percentiles}
