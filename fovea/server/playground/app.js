// The fovea playground: a chat with the served model over the server's own OpenAI routes (see playground.py).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "fovea-api-key";
const state = { history: [], attachments: [], controller: null, settings: null };

// ------------------------------------------------------------------------------------------ talking to the server

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function getJSON(path) {
  const reply = await fetch(path, { headers: headers() });
  if (reply.status === 401) throw Object.assign(new Error("unauthorized"), { unauthorized: true });
  if (!reply.ok) throw new Error(`${path}: ${reply.status}`);
  return reply.json();
}

async function start() {
  try {
    const models = await getJSON("/v1/models");
    state.settings = await getJSON("/playground/settings");
    $("model").replaceChildren(...models.data.map((m) => new Option(m.parent ? `${m.id} (LoRA)` : m.id, m.id)));
  } catch (error) {
    if (!error.unauthorized) throw error;
    const hadKey = sessionStorage.getItem(KEY_STORE) !== null;
    sessionStorage.removeItem(KEY_STORE);
    $("key-error").textContent = "That key was refused.";
    $("key-error").hidden = !hadKey;
    $("key-dialog").hidden = false;
    $("app").hidden = true;
    $("key-input").focus();
    return;
  }
  $("key-dialog").hidden = true;
  $("app").hidden = false;
  showDefaults(state.settings);
  pollMetrics();
  setInterval(pollMetrics, 2000);
}

function showDefaults(settings) {
  const d = settings.defaults || {};
  const shown = (name, fallback) => (name in d ? `default ${d[name]}` : fallback);
  $("temperature").placeholder = shown("temperature", "default 1.0");
  $("top-p").placeholder = shown("top_p", "default 1.0");
  $("max-tokens").placeholder = shown("max_tokens", `up to ${settings.max_model_len}`);
  $("seed").placeholder = "random";
  const list = Object.entries(d).map(([k, v]) => `${k}=${v}`).join(", ");
  $("defaults").textContent = `Left empty, a field takes the model's default${list ? ` (${list})` : " (none set)"}.`;
}

async function pollMetrics() {
  try {
    const text = await (await fetch("/metrics")).text();
    const sum = (name) => {
      const pattern = new RegExp(`^vllm:${name}(?:\\{[^}]*\\})? ([0-9.eE+-]+)$`, "gm");
      return [...text.matchAll(pattern)].reduce((total, m) => total + Number(m[1]), 0);
    };
    $("state-running").textContent = sum("num_requests_running");
    $("state-waiting").textContent = sum("num_requests_waiting");
    $("state-kv").textContent = `${(100 * sum("kv_cache_usage_perc")).toFixed(1)} %`;
  } catch {
    $("state-running").textContent = "?";
  }
}

// -------------------------------------------------------------------------------------------------- the answer

function requestBody() {
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const system = $("system").value.trim();
  const body = {
    model: $("model").value,
    messages: (system ? [{ role: "system", content: system }] : []).concat(state.history),
    stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature"),
    top_p: number("top-p"),
    max_tokens: number("max-tokens"),
    seed: number("seed"),
  };
  if ($("json-mode").checked) {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "playground", schema: JSON.parse($("json-schema").value || "{}") },
    };
  }
  return body;
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text && !state.attachments.length) return;
  showError("");
  const parts = state.attachments.map((a) =>
    a.video ? { type: "video_url", video_url: { url: a.url } } : { type: "image_url", image_url: { url: a.url } },
  );
  if (text) parts.push({ type: "text", text });
  let body;
  state.history.push({ role: "user", content: parts });
  try {
    body = requestBody();
  } catch (error) {
    state.history.pop();
    showError(`JSON schema: ${error.message}`);
    return;
  }
  addUserMessage(text, state.attachments);
  $("prompt").value = "";
  state.attachments = [];
  renderAttachments();
  const view = addAssistantMessage();
  const controller = (state.controller = new AbortController());
  setBusy(true);
  const started = performance.now();
  let firstAt = null;
  let answer = "";
  let reasoning = "";
  let usage = null;
  try {
    const reply = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!reply.ok) {
      const failure = await reply.json().catch(() => ({}));
      throw new Error(failure.error ? failure.error.message : `HTTP ${reply.status}`);
    }
    for await (const event of serverEvents(reply.body)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const delta = event.choices && event.choices[0] && event.choices[0].delta;
      if (!delta) continue;
      const thought = delta.reasoning_content || delta.reasoning || "";
      if ((delta.content || thought) && firstAt === null) firstAt = performance.now();
      if (thought) view.setReasoning((reasoning += thought));
      if (delta.content) view.setContent((answer += delta.content));
    }
    view.setStats(stats(started, firstAt, performance.now(), usage));
  } catch (error) {
    if (error.name === "AbortError") view.setStopped();
    else view.setError(error.message);
  } finally {
    state.controller = null;
    setBusy(false);
    if (answer) state.history.push({ role: "assistant", content: answer });
  }
}

async function* serverEvents(stream) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function stats(started, firstAt, endedAt, usage) {
  const parts = [];
  if (firstAt !== null) parts.push(`TTFT ${Math.round(firstAt - started)} ms`);
  if (usage) {
    const seconds = (endedAt - (firstAt ?? started)) / 1000;
    if (usage.completion_tokens > 1 && seconds > 0) {
      parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tokens/s`);
    }
    const details = usage.prompt_tokens_details || {};
    const image = details.image_tokens ? ` (${details.image_tokens} image)` : "";
    parts.push(`${usage.prompt_tokens} prompt tokens${image}`, `${usage.completion_tokens} output tokens`);
    if (details.cached_tokens) parts.push(`${details.cached_tokens} cached`);
  }
  return parts.join(" · ");
}

// ------------------------------------------------------------------------------------------------------ the view

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function thumbnail(attachment) {
  const node = element(attachment.video ? "video" : "img");
  node.src = attachment.url;
  node.title = attachment.name;
  return node;
}

function addUserMessage(text, attachments) {
  const node = element("div", "msg user");
  if (attachments.length) {
    const thumbs = element("div", "thumbs");
    thumbs.append(...attachments.map(thumbnail));
    node.append(thumbs);
  }
  node.append(element("div", "content", text));
  $("messages").append(node);
  node.scrollIntoView({ block: "end" });
}

const RENDER_MS = 50;

function addAssistantMessage() {
  const node = element("div", "msg assistant");
  const reasoning = element("details", "reasoning");
  reasoning.hidden = true;
  reasoning.open = true; // shown as it streams; a click folds it
  reasoning.append(element("summary", "", "reasoning"), element("div"));
  const content = element("div", "content");
  const footer = element("div", "stats");
  node.append(reasoning, content, footer);
  $("messages").append(node);
  const follow = () => node.scrollIntoView({ block: "end" });
  // The answer is drawn at most every RENDER_MS, not at every token: drawing it all again per token is quadratic,
  // and a long answer kept the page too busy for anything else (its /metrics poll among them).
  let latest = null;
  let timer = null;
  let drawnAt = 0;
  const draw = () => {
    timer = null;
    drawnAt = performance.now();
    if (latest !== null) content.innerHTML = renderMarkdown(latest);
    follow();
  };
  const later = () => {
    if (timer === null) timer = setTimeout(draw, Math.max(0, RENDER_MS - (performance.now() - drawnAt)));
  };
  const flush = () => {
    if (timer !== null) {
      clearTimeout(timer);
      draw();
    }
  };
  return {
    setReasoning(text) {
      reasoning.hidden = false;
      reasoning.lastChild.textContent = text;
      later();
    },
    setContent(text) {
      latest = text;
      later();
    },
    setStats(text) {
      flush();
      footer.textContent = text;
    },
    setStopped() {
      flush();
      footer.append(element("span", "stopped", "stopped"));
    },
    setError(message) {
      flush();
      footer.append(element("span", "error", message));
    },
  };
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.history = [];
  state.attachments = [];
  renderAttachments();
  $("messages").replaceChildren();
  showError("");
}

// --------------------------------------------------------------------------------------------------- attachments

function addFiles(files) {
  for (const file of files) {
    if (!/^(image|video)\//.test(file.type)) {
      showError(`${file.name}: not an image or a video`);
      continue;
    }
    const reader = new FileReader();
    reader.onload = () => {
      state.attachments.push({ url: reader.result, name: file.name, video: file.type.startsWith("video/") });
      renderAttachments();
    };
    reader.readAsDataURL(file);
  }
}

function renderAttachments() {
  $("attachments").replaceChildren(
    ...state.attachments.map((attachment, index) => {
      const chip = element("span", "chip");
      const remove = element("button", "", "×");
      remove.type = "button";
      remove.title = "remove";
      remove.onclick = () => {
        state.attachments.splice(index, 1);
        renderAttachments();
      };
      chip.append(thumbnail(attachment), remove);
      return chip;
    }),
  );
}

// ------------------------------------------------------------------------------------------------------ wiring

document.addEventListener("DOMContentLoaded", () => {
  $("key-dialog").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("key-input").value);
    $("key-input").value = "";
    start();
  });
  $("send").onclick = send;
  $("stop").onclick = () => state.controller && state.controller.abort();
  $("new-chat").onclick = newChat;
  $("attach").onclick = () => $("file").click();
  $("file").onchange = (event) => {
    addFiles(event.target.files);
    event.target.value = "";
  };
  $("json-mode").onchange = (event) => ($("json-schema").hidden = !event.target.checked);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !$("send").disabled) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("paste", (event) => {
    const files = [...event.clipboardData.items].filter((i) => i.kind === "file").map((i) => i.getAsFile());
    if (files.length) {
      event.preventDefault();
      addFiles(files);
    }
  });
  document.addEventListener("dragover", (event) => {
    event.preventDefault();
    document.body.classList.add("dragging");
  });
  document.addEventListener("dragleave", () => document.body.classList.remove("dragging"));
  document.addEventListener("drop", (event) => {
    event.preventDefault();
    document.body.classList.remove("dragging");
    addFiles(event.dataTransfer.files);
  });
  start();
});
