"""The web playground in a real browser: Debian's Chromium driven by Playwright against a `fovea serve` with an API
key. The key flow, an image attached (file picker, drag and drop, paste), a streamed answer and its numbers
against what /v1 says of the same request, a stream stopped, JSON-schema mode, the server-state panel; and, with
canned replies, reasoning shown apart and model text that cannot become markup. A screenshot is kept in
test-artifacts/ (FOVEA_TEST_ARTIFACTS)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from conftest import random_image, video_file
from serving import running_server

KEY = "playground-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("FOVEA_TEST_ARTIFACTS", Path(__file__).parents[1] / "test-artifacts"))
# as root, with no network: no sandbox, and none of Chromium's background connections (refused here)
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine (.ci/run installs Debian's chromium; apt was not possible)"
)


@pytest.fixture(scope="module")
def server(tiny_dirs):
    flags = ["--dtype", "float32", "--served-model-name", "tiny", "--api-key", KEY]
    with running_server(tiny_dirs["tiny-3b"], *flags) as (base, _):
        yield base


playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is in the test extras")
expect = playwright.expect  # its waits run in Playwright's own world: the page's CSP (no eval) stays on


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture
def page(server, browser):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(server + "/")
    page.fill("#key-input", KEY)
    page.click("#key-submit")
    page.wait_for_selector("#app:not([hidden])")
    yield page
    context.close()
    assert not errors, f"the page's script failed: {errors}"


def png(path: Path, seed: int) -> Path:
    random_image(112, 84, seed=seed).save(path)
    return path


def wait_answer(page, index: int = 0):
    """The index-th assistant message, once its stream has ended (numbers shown, or stopped)."""
    stats = page.locator(".msg.assistant .stats").nth(index)
    stats.filter(has_text="tokens").or_(stats.filter(has_text="stopped")).wait_for(timeout=60_000)
    return page.locator(".msg.assistant").nth(index)


def test_the_key_is_asked_for_and_kept_in_the_tab_only(server, browser):
    assert httpx.get(server + "/playground/settings").status_code == 401  # behind the key, like /v1
    assert "script-src 'self'" in httpx.get(server + "/").headers["content-security-policy"]
    page = browser.new_page()
    page.goto(server + "/playground")
    page.wait_for_selector("#key-dialog:not([hidden])")
    assert page.is_hidden("#app")
    page.fill("#key-input", "wrong")
    page.click("#key-submit")
    page.wait_for_selector("#key-error:not([hidden])")
    assert "refused" in page.inner_text("#key-error")
    page.fill("#key-input", KEY)
    page.click("#key-submit")
    page.wait_for_selector("#app:not([hidden])")
    assert page.evaluate("sessionStorage.getItem('fovea-api-key')") == KEY
    assert page.evaluate("localStorage.length") == 0 and page.evaluate("document.cookie") == ""
    assert page.locator("#model option").all_inner_texts() == ["tiny"]
    page.close()


def test_an_image_question_streams_with_its_numbers(server, page, tmp_path):
    defaults = httpx.get(server + "/playground/settings", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert "repetition_penalty=1.05" in page.inner_text("#defaults")
    assert page.get_attribute("#temperature", "placeholder") == f"default {defaults['defaults']['temperature']}"
    page.set_input_files("#file", str(png(tmp_path / "a.png", seed=1)))
    page.wait_for_selector("#attachments img")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "6")
    page.fill("#prompt", "What is in this picture?")
    page.click("#send")
    answer = wait_answer(page)
    assert page.locator(".msg.user img").count() == 1 and page.locator("#attachments img").count() == 0
    stats = answer.locator(".stats").inner_text()
    # the same request over /v1: the page's numbers are the server's
    image = base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    reply = httpx.post(
        server + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": "tiny",
            "temperature": 0,
            "max_tokens": 6,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                        {"type": "text", "text": "What is in this picture?"},
                    ],
                }
            ],
        },
        timeout=60,
    ).json()
    usage = reply["usage"]
    image_tokens = usage["prompt_tokens_details"]["image_tokens"]
    assert f"{usage['prompt_tokens']} prompt tokens ({image_tokens} image)" in stats
    assert "TTFT" in stats and "tokens/s" in stats and "6 output tokens" in stats
    assert answer.locator(".content").inner_text().strip()
    expect(page.locator("#state-kv")).to_have_text(re.compile("%$"))
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground.png"))


def test_drop_paste_stop_and_new_chat(page, tmp_path):
    data = base64.b64encode(png(tmp_path / "b.png", seed=2).read_bytes()).decode()
    page.evaluate(
        """(data) => {
            const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
            const make = () => { const dt = new DataTransfer(); dt.items.add(new File([bytes], 'b.png', {type: 'image/png'})); return dt; };
            document.dispatchEvent(new DragEvent('drop', {dataTransfer: make(), bubbles: true, cancelable: true}));
            document.dispatchEvent(new ClipboardEvent('paste', {clipboardData: make(), bubbles: true, cancelable: true}));
        }""",
        data,
    )
    expect(page.locator("#attachments img")).to_have_count(2)
    page.click("#attachments .chip button")  # one removed again
    assert page.locator("#attachments img").count() == 1
    page.fill("#max-tokens", "4000")
    page.fill("#prompt", "Tell me a very long story.")
    page.press("#prompt", "Enter")
    expect(page.locator(".msg.assistant .content")).to_have_text(re.compile(".{20}"), timeout=60_000)
    assert page.is_enabled("#stop") and page.is_disabled("#send")  # still streaming
    expect(page.locator("#state-running")).to_have_text("1", timeout=10_000)  # from /metrics
    page.click("#stop")
    assert "stopped" in wait_answer(page).locator(".stats").inner_text()
    assert page.is_enabled("#send")
    expect(page.locator("#state-running")).to_have_text("0", timeout=10_000)  # the server aborted it
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0


def test_a_video_is_attached_and_answered(page, tmp_path):
    import numpy as np

    frames = np.random.default_rng(0).integers(0, 255, (4, 56, 84, 3), dtype=np.uint8)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(video_file(frames, fps=2, lossless=False))
    page.set_input_files("#file", str(clip))
    expect(page.locator("#attachments video")).to_have_count(1)
    page.fill("#max-tokens", "3")
    page.fill("#prompt", "What happens?")
    page.click("#send")
    stats = wait_answer(page).locator(".stats").inner_text()
    assert re.search(r"\d+ prompt tokens \(\d+ image\)", stats), stats  # the video's tokens are counted
    assert page.locator(".msg.user video").count() == 1


def test_json_schema_mode(page):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,  # a random model's free keys never end
    }
    page.check("#json-mode")
    page.fill("#json-schema", json.dumps(schema))
    page.fill("#temperature", "0")
    page.fill("#prompt", "Pick a colour.")
    page.click("#send")
    text = wait_answer(page).locator(".content").inner_text()
    assert json.loads(text)["colour"] in ("red", "blue")
    page.fill("#json-schema", "{not json")
    page.fill("#prompt", "Again.")
    page.click("#send")
    page.wait_for_selector("#error:not([hidden])")
    assert "JSON schema" in page.inner_text("#error")


def canned(events: list[dict]) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_reasoning_apart_and_text_never_markup(page):
    """Canned server replies (the server's reasoning output is tested in test_reasoning.py): the page shows the
    reasoning in its own fold, renders markdown, and an answer holding HTML stays text."""
    deltas = [
        {"choices": [{"index": 0, "delta": {"reasoning_content": "Let me think."}}]},
        {"choices": [{"index": 0, "delta": {"content": "**Bold** and <img src=x onerror=alert(1)>"}}]},
        {"choices": [{"index": 0, "delta": {"content": "\n\n- one\n- two\n\n[link](javascript:alert(1))"}}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}},
    ]
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=canned(deltas)),
    )
    page.fill("#prompt", "Think first.")
    page.click("#send")
    answer = wait_answer(page)
    assert answer.locator(".reasoning").is_visible()
    assert answer.locator(".reasoning div").inner_text() == "Let me think."
    content = answer.locator(".content")
    assert content.locator("strong").inner_text() == "Bold"
    assert content.locator("li").all_inner_texts() == ["one", "two"]
    assert content.locator("img").count() == 0 and content.locator("a").count() == 0
    assert "<img src=x onerror=alert(1)>" in content.inner_text()
    assert "Let me think." not in content.inner_text()
