"""Chat templates sent with requests (only with --trust-request-chat-template) run in worker processes.

A template is a program: Jinja's sandbox keeps it from reaching Python internals, but not from looping for
minutes or building a gigabyte string, and even parsing one can take seconds and recurse past Python's stack
(a 2 MB `{{ a+a+...+a }}`). Every step of a client's template runs here: reading its content format, rendering. So client templates render in separate processes (fovea/worker_pool.py),
each with a memory cap (RLIMIT_AS), a time limit (the worker is killed and replaced when it overruns) and a cap
on the output's length; a request waits at most as long as the time limit for a free worker. The server's own
template (the checkpoint's, or --chat-template) is trusted and renders in process.
"""

from __future__ import annotations

from fovea.multimodal.chat_format import as_string_content, detect_content_format
from fovea.multimodal.prompt import ChatOptions
from fovea.worker_pool import WorkerFailed, WorkerPool, answer_jobs, ignore_group_signals


def _render_worker(conn, model_dir: str, memory_bytes: int, max_chars: int) -> None:
    import resource

    from transformers import AutoTokenizer  # the same tokenizer call the server's own template goes through

    ignore_group_signals()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open("/proc/self/statm") as statm:  # pages of virtual memory in use now, tokenizer loaded
        in_use = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (in_use + memory_bytes, in_use + memory_bytes))
    conn.send("ready")

    def render(job) -> tuple[bool, str]:
        messages, chat, placeholders = job
        # reading the template's syntax is running client input too: here, under the same bounds
        content_format = chat.content_format
        if content_format == "auto":
            content_format = detect_content_format(chat.template)
        if content_format == "string":
            messages = as_string_content(messages, placeholders)
        text = chat.render(tokenizer, messages, chat.template)
        if len(text) > max_chars:
            return False, f"the chat template wrote {len(text)} characters, more than the {max_chars} allowed"
        return True, text

    answer_jobs(conn, render, _render_failed)


def _render_failed(error: Exception, job) -> tuple[bool, str]:
    """The template's own failure, reported to its request."""
    if isinstance(error, MemoryError):
        return False, "the chat template used more memory than allowed"
    return False, f"the chat template failed on these messages: {type(error).__name__}: {error}"


class TemplateSandbox:
    def __init__(
        self, model_dir: str, max_chars: int, workers: int = 2, timeout_s: float = 2.0, memory_bytes: int = 512 << 20
    ):
        self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
        self.pool = WorkerPool(_render_worker, (model_dir, memory_bytes, max_chars), workers, "chat template")

    def render(self, messages: list[dict], chat: ChatOptions, placeholders: dict[str, str]) -> str:
        """Blocking (call it from a thread): the rendered prompt, or ValueError saying what went wrong. `messages`
        hold their content as lists of parts; a "string" template gets it joined (`placeholders` per medium)."""
        try:
            ok, result = self.pool.call((messages, chat, placeholders), self.timeout_s)
        except TimeoutError:
            raise ValueError("all chat template workers are busy; retry shortly") from None
        except WorkerFailed:
            raise ValueError(
                f"the chat template did not finish within {self.timeout_s:g} s and {self.memory_bytes >> 20} MiB"
            ) from None
        if not ok:
            raise ValueError(result)
        return result

    def close(self) -> None:
        self.pool.close()
