// The chat page's logic: a client of this server's /v1/chat/completions like any other (streamed,
// with usage), plus the conversation and settings kept in the browser's localStorage. Text from
// the model or the user reaches the page only through LilyMarkdown (DOM nodes, never HTML) or
// textContent.
"use strict";

const STORE = "lily.chat.v1"; // {messages, settings}
const KEY_STORE = "lily.apiKey";
const RENDER_EVERY_MS = 50; // how often a streaming answer is redrawn

const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"), input: $("input"), send: $("send"), stop: $("stop"),
  composer: $("composer"), newChat: $("new-chat"), model: $("model-name"),
  settingsToggle: $("settings-toggle"), settings: $("settings"), system: $("system-prompt"),
  thinking: $("thinking"), temperature: $("temperature"), topP: $("top-p"),
  maxTokens: $("max-tokens"), forgetKey: $("forget-key"), keyDialog: $("key-dialog"),
  keyForm: $("key-form"), keyInput: $("key-input"), keyError: $("key-error"),
};

const DEFAULT_SETTINGS = { system: "", thinking: true, temperature: "", topP: "", maxTokens: "" };
let chat = loadChat();
let running = null; // {controller, answer} while an answer streams

// ---- storage ---------------------------------------------------------------------------------

function loadChat() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(STORE) || "{}") || {};
  } catch (e) {
    saved = {};
  }
  const messages = Array.isArray(saved.messages) ? saved.messages.filter(
    (m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string") : [];
  for (const m of messages) {
    // An answer that was streaming when the page went away stays as far as it got.
    if (m.pending) {
      m.pending = false;
      m.note = m.note || "Interrupted: the page was closed or reloaded while this answer streamed.";
    }
  }
  return { messages, settings: { ...DEFAULT_SETTINGS, ...(saved.settings || {}) } };
}

function saveChat() {
  try {
    localStorage.setItem(STORE, JSON.stringify(chat));
  } catch (e) {
    // Storage full or disabled: the conversation still works, it just won't survive a reload.
  }
}

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

// ---- rendering -------------------------------------------------------------------------------

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function messageNode(m) {
  const node = el("div", "msg " + m.role + (m.pending ? " pending" : ""));
  node.appendChild(el("div", "role", m.role === "user" ? "You" : "Lily"));
  if (m.role === "user") {
    node.appendChild(el("div", "text", m.content));
    return node;
  }
  if (m.reasoning) {
    const details = node.appendChild(el("details", "thinking"));
    // Open while the model is still thinking; folded once the answer starts (a click reopens it).
    const auto = Boolean(m.pending && !m.content);
    details.open = m.showReasoning !== undefined ? m.showReasoning : auto;
    details.addEventListener("toggle", () => {
      // Setting `open` above fires a toggle too; only a reader's click is remembered.
      if (details.open !== auto || m.showReasoning !== undefined) m.showReasoning = details.open;
    });
    details.appendChild(el("summary", null, m.pending && !m.content ? "Thinking…" : "Thinking"));
    details.appendChild(el("div", "reasoning")).appendChild(LilyMarkdown.render(m.reasoning));
  }
  node.appendChild(el("div", "text")).appendChild(LilyMarkdown.render(m.content));
  if (m.stats) node.appendChild(el("div", "stats", m.stats));
  if (m.note) node.appendChild(el("div", "note" + (m.error ? " error" : ""), m.note));
  return node;
}

function nearBottom() {
  const box = ui.messages;
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

function renderAll() {
  ui.messages.replaceChildren(...chat.messages.map(messageNode));
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function renderMessage(m) {
  const i = chat.messages.indexOf(m);
  const old = ui.messages.children[i];
  if (!old) return renderAll();
  const follow = nearBottom();
  old.replaceWith(messageNode(m));
  if (follow) ui.messages.scrollTop = ui.messages.scrollHeight;
}

let redraw = null;
function scheduleRender(m) {
  if (redraw === null) {
    redraw = setTimeout(() => {
      redraw = null;
      renderMessage(m);
    }, RENDER_EVERY_MS);
  }
}

function setRunning(r) {
  running = r;
  ui.send.hidden = Boolean(r);
  ui.stop.hidden = !r;
  if (!r) ui.input.focus();
}

// ---- the API ---------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h.Authorization = "Bearer " + apiKey();
  return h;
}

function number(value) {
  return value === "" || value === null || value === undefined ? undefined : Number(value);
}

function requestBody(upTo) {
  const s = chat.settings;
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of chat.messages.slice(0, upTo)) {
    // Answers that failed before saying anything are not part of the conversation.
    if (m.role === "assistant" && !m.content) continue;
    messages.push({ role: m.role, content: m.content });
  }
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    chat_template_kwargs: { enable_thinking: Boolean(s.thinking) },
  };
  for (const [field, value] of [["temperature", s.temperature], ["top_p", s.topP], ["max_tokens", s.maxTokens]]) {
    if (number(value) !== undefined) body[field] = number(value);
  }
  return body;
}

// What to tell the user about an error object (`{message, code}`) that came with `status`.
function explain(status, error) {
  const message = (error && error.message) || "no details";
  if (error && error.code === "context_length_exceeded") {
    return "The conversation no longer fits the model's context (" + message +
      "). Start a new conversation, or lower Max tokens in Settings.";
  }
  switch (status) {
    case 401:
      return "The server refused the API key (401: " + message + ").";
    case 429:
      return "The server is busy: too many requests are waiting (429: " + message + "). Try again in a moment.";
    case 503:
      return "The server is busy or not ready (503: " + message + "). Try again in a moment.";
    default:
      return "The server answered " + status + ": " + message;
  }
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return body.error || {};
  } catch (e) {
    return {};
  }
}

// Reads a server-sent-events body, calling onData with each `data:` payload.
async function readEvents(body, onData) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length && onData(data.join("\n")) === false) return;
    }
  }
}

async function answer(m) {
  const controller = new AbortController();
  setRunning({ controller, answer: m });
  const body = requestBody(chat.messages.indexOf(m));
  const started = performance.now();
  let first = null;
  let usage = null;
  let finish = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      const error = await errorOf(response);
      m.note = explain(response.status, error);
      m.error = true;
      if (response.status === 401) askForKey(m.note);
      return;
    }
    await readEvents(response.body, (data) => {
      if (data === "[DONE]") return false;
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch (e) {
        return true;
      }
      if (chunk.error) {
        m.note = "The answer broke off: " + (chunk.error.message || "server error");
        m.error = true;
        return false;
      }
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return true;
      const delta = choice.delta || {};
      if (delta.reasoning_content || delta.content) {
        if (first === null) first = performance.now();
        m.reasoning += delta.reasoning_content || "";
        m.content += delta.content || "";
        scheduleRender(m);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      return true;
    });
    if (finish === "length") {
      const limit = number(chat.settings.maxTokens);
      m.note = usage && limit !== undefined && usage.completion_tokens >= limit
        ? "Cut at Max tokens (" + limit + ")."
        : "The context is full: the answer was cut. Start a new conversation to go on.";
    }
  } catch (e) {
    if (e.name === "AbortError") {
      m.note = "Stopped.";
    } else {
      m.note = "Cannot reach the server: " + e.message;
      m.error = true;
    }
  } finally {
    const ended = performance.now();
    m.stats = stats(usage, first === null ? null : first - started, first === null ? null : ended - first);
    m.pending = false;
    clearTimeout(redraw);
    redraw = null;
    saveChat();
    renderMessage(m);
    setRunning(null);
  }
}

// "N tokens · TTFT x s · y tok/s": the tokens from the stream's usage, the times as seen here.
function stats(usage, ttftMs, decodeMs) {
  if (!usage) return ttftMs === null ? "" : "TTFT " + (ttftMs / 1000).toFixed(2) + " s";
  const n = usage.completion_tokens;
  const parts = [n + (n === 1 ? " token" : " tokens")];
  if (ttftMs !== null) parts.push("TTFT " + (ttftMs / 1000).toFixed(2) + " s");
  if (n > 1 && decodeMs > 0) parts.push(((n - 1) / (decodeMs / 1000)).toFixed(1) + " tok/s");
  const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
  parts.push("prompt " + usage.prompt_tokens + (cached ? " (" + cached + " reused)" : ""));
  return parts.join(" · ");
}

function send() {
  const text = ui.input.value;
  if (running || !text.trim()) return;
  ui.input.value = "";
  chat.messages.push({ role: "user", content: text });
  const m = { role: "assistant", content: "", reasoning: "", pending: true };
  chat.messages.push(m);
  saveChat();
  renderAll();
  answer(m);
}

// ---- the API key -----------------------------------------------------------------------------

function askForKey(message) {
  ui.keyError.textContent = message || "";
  ui.keyDialog.hidden = false;
  ui.keyInput.value = "";
  ui.keyInput.focus();
}

// Asks the server whether the stored key (or none) lets us in; shows the model's name if so.
async function checkAccess() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    ui.model.textContent = "server unreachable";
    return;
  }
  if (response.status === 401) {
    const error = await errorOf(response);
    askForKey(apiKey() ? explain(401, error) : "");
    return;
  }
  ui.keyDialog.hidden = true;
  ui.forgetKey.hidden = !apiKey();
  if (response.ok) {
    const body = await response.json().catch(() => ({}));
    const card = body.data && body.data[0];
    if (card) ui.model.textContent = card.id + (card.max_model_len ? " · context " + card.max_model_len : "");
  }
}

// ---- wiring ----------------------------------------------------------------------------------

function bindSettings() {
  const fields = [
    [ui.system, "system", "value"], [ui.thinking, "thinking", "checked"],
    [ui.temperature, "temperature", "value"], [ui.topP, "topP", "value"], [ui.maxTokens, "maxTokens", "value"],
  ];
  for (const [input, name, prop] of fields) {
    input[prop] = chat.settings[name];
    input.addEventListener(prop === "checked" ? "change" : "input", () => {
      chat.settings[name] = input[prop];
      saveChat();
    });
  }
}

ui.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
ui.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
ui.stop.addEventListener("click", () => running && running.controller.abort());
ui.newChat.addEventListener("click", () => {
  if (running) running.controller.abort();
  chat.messages = [];
  saveChat();
  renderAll();
  ui.input.focus();
});
ui.settingsToggle.addEventListener("click", () => {
  ui.settings.hidden = !ui.settings.hidden;
  ui.settingsToggle.setAttribute("aria-expanded", String(!ui.settings.hidden));
});
ui.forgetKey.addEventListener("click", () => {
  localStorage.removeItem(KEY_STORE);
  checkAccess();
});
ui.keyForm.addEventListener("submit", (e) => {
  e.preventDefault();
  const key = ui.keyInput.value.trim();
  if (!key) {
    ui.keyError.textContent = "Enter the key the server was started with (--api-key).";
    return;
  }
  localStorage.setItem(KEY_STORE, key);
  checkAccess();
});

bindSettings();
renderAll();
checkAccess();
ui.input.focus();
