"""Where `fovea eval` gets its answers: fovea's `LLM` in this process, or any OpenAI-compatible server.
(fovea/eval/ray_backend.py spreads the in-process engine over Ray replicas.)

A backend turns a list of chat conversations into one Completion each, in the same order. A sample that cannot
be answered (an image the engine cannot decode, a request the server rejects) gets a Completion with an error and
empty text, which the runner counts as missing: one bad file does not end a run over thousands.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from fovea.eval.registry import ModelEntry
from fovea.eval.tasks import data_url
from fovea.multimodal.fetch import file_url_path


@dataclass
class Completion:
    text: str
    latency: float  # seconds from submission to the last token
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def _progress(desc: str | None, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="sample", dynamic_ncols=True, disable=desc is None)


class InProcessBackend:
    def __init__(self, entry: ModelEntry, **engine_overrides):
        from fovea import LLM

        self.description = "in-process"
        self.llm = LLM(entry.path, **{**entry.llm_kwargs(), **engine_overrides})

    def close(self) -> None:
        self.llm.close()

    def complete(self, conversations: list[list[dict]], params: dict, desc: str | None = None) -> list[Completion]:
        """`params`: SamplingParams fields. `desc`: the progress bar's label (None: no bar)."""
        from fovea import SamplingParams

        sampling = SamplingParams(**params)
        bar = partial(_progress, desc) if desc is not None else False
        try:
            outputs = self.llm.chat(conversations, sampling, use_tqdm=bar)
        except ValueError as exc:  # some conversation is bad: find which, answer the rest
            return self._complete_good_ones(conversations, params, exc)
        return [
            Completion(
                o.outputs[0].text,
                o.metrics.finished_time - o.metrics.arrival_time,
                len(o.prompt_token_ids),
                len(o.outputs[0].token_ids),
            )
            for o in outputs
        ]

    def _complete_good_ones(self, conversations, params, failure: ValueError) -> list[Completion]:
        errors = {}
        for i, conversation in enumerate(conversations):
            try:
                self.llm.inputs.process_chat(conversation)
            except ValueError as exc:
                errors[i] = str(exc)
        if not errors:  # not one conversation's fault
            raise failure
        good = [c for i, c in enumerate(conversations) if i not in errors]
        answered = iter(self.complete(good, params) if good else [])
        return [
            Completion("", 0.0, error=errors[i]) if i in errors else next(answered) for i in range(len(conversations))
        ]


class OpenAIBackend:
    """Chat completions from a server (`fovea serve`, `vllm serve`, ...), `concurrency` requests at a time. Local
    images travel as data URLs, since the server cannot be assumed to see our files."""

    RETRIES = 3  # for 5xx answers and dropped connections; a 4xx answer is the sample's own fault

    def __init__(
        self,
        base_url: str,
        entry: ModelEntry,
        api_key: str | None = None,
        concurrency: int = 32,
        timeout: float = 600.0,
    ):
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.entry, self.concurrency, self.timeout = entry, concurrency, timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = self._served_model()
        self.description = f"{self.root} ({self.model})"

    def _served_model(self) -> str:
        import httpx

        try:
            response = httpx.get(f"{self.root}/v1/models", headers=self.headers, timeout=30)
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot reach the server at {self.root}: {exc}") from None
        if response.status_code != 200:
            raise ValueError(f"{self.root}/v1/models answered {response.status_code}: {response.text[:200]}")
        cards = response.json().get("data", [])
        for name in (self.entry.path, self.entry.name):
            if any(card["id"] == name for card in cards):
                return name
        for card in cards:  # served under another name: the server says where it loaded the model from
            if self._loaded_from(str(card.get("root") or "")):
                return card["id"]
        served = [card["id"] for card in cards]
        raise ValueError(f"the server serves {served}, not {self.entry.path!r}: pass one of them as --model")

    def _loaded_from(self, root: str) -> bool:
        """Whether a served model's directory is this entry's model: the same directory, or the hub's copy of it."""
        path = self.entry.path
        if not root:
            return False
        if Path(path).is_dir():
            return Path(path).resolve() == Path(root).resolve()
        return f"models--{path.replace('/', '--')}" in Path(root).parts

    def complete(self, conversations: list[list[dict]], params: dict, desc: str | None = None) -> list[Completion]:
        return asyncio.run(self._complete_all(conversations, params, desc))

    async def _complete_all(self, conversations, params, desc) -> list[Completion]:
        import httpx

        bar = _progress(desc, len(conversations))
        limits = httpx.Limits(max_connections=self.concurrency)
        slots = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits, headers=self.headers) as client:

            async def one(conversation):
                async with slots:
                    completion = await self._complete_one(client, conversation, params)
                bar.update(1)
                return completion

            try:
                return await asyncio.gather(*(one(c) for c in conversations))
            finally:
                bar.close()

    async def _complete_one(self, client, conversation, params) -> Completion:
        import httpx

        try:
            body = {"model": self.model, "messages": inline_local_images(conversation), **params}
        except OSError as exc:
            return Completion("", 0.0, error=f"cannot read the image: {exc}")
        for attempt in range(self.RETRIES + 1):
            start = time.perf_counter()
            try:
                response = await client.post(f"{self.root}/v1/chat/completions", json=body)
            except httpx.TransportError as exc:
                if attempt == self.RETRIES:
                    raise ValueError(f"the server at {self.root} stopped answering: {exc!r}") from None
            else:
                latency = time.perf_counter() - start
                if response.status_code == 200:
                    answer = response.json()
                    usage = answer.get("usage") or {}
                    return Completion(
                        answer["choices"][0]["message"].get("content") or "",
                        latency,
                        usage.get("prompt_tokens", 0),
                        usage.get("completion_tokens", 0),
                    )
                if response.status_code < 500 or attempt == self.RETRIES:
                    return Completion("", latency, error=f"HTTP {response.status_code}: {response.text[:500]}")
            await asyncio.sleep(0.5 * 2**attempt * (1 + random.random()))


def inline_local_images(conversation: list[dict]) -> list[dict]:
    """The conversation with file:// image and video URLs turned into data URLs."""

    def inline(part):
        kind = part.get("type")
        url = part.get(kind, {}).get("url", "") if kind in ("image_url", "video_url") else ""
        if not url.startswith("file://"):
            return part
        return {**part, kind: {"url": data_url(file_url_path(url).read_bytes(), kind[:-4])}}

    return [
        {**m, "content": [inline(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
        for m in conversation
    ]
