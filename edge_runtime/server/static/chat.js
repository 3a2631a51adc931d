// The chat page's behaviour (index.html holds its structure, chat.css its looks, markdown.js the renderer).
//
// Conversations live in the browser's localStorage under "edge-runtime.chats": a list, newest first, of
// {id, title, updated, messages}. A message is {id, role, content} and, for an answer, also `runs` (the
// offsets where its source changes: [{source, start}]), `handoffs` ([{from, to, reason, at}]: at = a
// character offset), `route`, `state` (streaming | done | cancelled | error), `end` (its summary line) and
// `lastN` (the last stream frame received). Each answer streams over the gateway's WebSocket /v1/stream
// (same host); its id is the stream id, so an answer still streaming when the page is reloaded is resumed
// from `lastN` (the server keeps a dropped stream's frames for its grace period).
// Sampling: the page sends params {max_tokens, temperature} from its settings row; on load it reads
// GET /health and fills temperature with the server's sampling defaults, shown beside it with their source.
// With temperature 0 an answer here equals the API's greedy answer for the same question.
"use strict";
const $ = (id) => document.getElementById(id);
const STORE = "edge-runtime.chats", KEY_STORE = "edge-runtime.api-key";
const streams = new Map();   // message id -> {chat, msg, t0, first, last, tokens}: the running answers
let ws = null, ready = null, retries = 0, counter = 0;
let chats = load(), chat = null, saveTimer = null;

const uid = (p) => p + Date.now().toString(36) + "-" + (counter++) + Math.random().toString(36).slice(2, 6);
const status = (text) => { $("status").textContent = text; };

function load() {
  try {
    const v = JSON.parse(localStorage.getItem(STORE) || "[]");
    return Array.isArray(v) ? v.filter((c) => c && Array.isArray(c.messages)) : [];
  } catch (e) {
    return [];
  }
}

// Saves every chat that has a message; when the browser's quota is hit, the oldest chats go first.
function save() {
  clearTimeout(saveTimer);
  saveTimer = null;
  const kept = chats.filter((c) => c.messages.length);
  for (;;) {
    try {
      localStorage.setItem(STORE, JSON.stringify(kept));
      return;
    } catch (e) {
      if (kept.length <= 1) { status("could not save the conversation: " + e.message); return; }
      kept.pop();
    }
  }
}
const saveSoon = () => { if (!saveTimer) saveTimer = setTimeout(save, 1000); };

// ---- drawing ----------------------------------------------------------------------------------------------

function marker(h) {
  const e = document.createElement("span");
  e.className = "handoff";
  e.dataset.from = h.from; e.dataset.to = h.to;
  e.textContent = `${h.from} \u2192 ${h.to}: ${h.reason}`;
  return e;
}

// The answer as markdown, each range of text in a span of the source that wrote it, hand-offs in place.
function drawAnswer(box, msg) {
  box.textContent = "";
  if (msg.role === "user") { box.textContent = msg.content; return; }
  const runs = msg.runs || [], marks = (msg.handoffs || []).slice();
  renderMarkdown(box, msg.content, (start, end, parent) => {
    for (let at = start; at < end;) {
      while (marks.length && marks[0].at <= at) parent.appendChild(marker(marks.shift()));
      let r = runs.length - 1;
      while (r > 0 && runs[r].start > at) r--;
      let stop = r + 1 < runs.length ? Math.min(end, runs[r + 1].start) : end;
      if (marks.length && marks[0].at > at) stop = Math.min(stop, marks[0].at);
      const span = document.createElement("span");
      span.dataset.source = runs.length ? runs[r].source : "local";
      span.textContent = msg.content.slice(at, stop);
      parent.appendChild(span);
      at = stop;
    }
  });
  for (const h of marks) box.appendChild(marker(h));
  for (const pre of box.querySelectorAll("pre")) pre.before(copyButton(() => pre.textContent, "copy-code"));
}

function copyButton(what, cls) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "copy " + cls;
  b.title = b.ariaLabel = "Copy";
  b.addEventListener("click", () => copy(what(), b));
  return b;
}

async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (e) {  // no clipboard API (a page over plain http on another host): the old way
    const t = document.createElement("textarea");
    t.value = text;
    document.body.appendChild(t);
    t.select();
    document.execCommand("copy");
    t.remove();
  }
  if (button) { button.dataset.done = "1"; setTimeout(() => delete button.dataset.done, 1500); }
}

function drawMessage(msg) {
  let e = document.querySelector(`.msg[data-mid="${CSS.escape(msg.id)}"]`);
  if (!e) {
    e = document.createElement("div");
    e.className = "msg " + msg.role;
    e.dataset.mid = msg.id;
    e.innerHTML = '<div class="route"></div><div class="answer"></div><div class="foot"><span class="end"></span></div>';
    if (msg.role === "assistant") e.querySelector(".foot").appendChild(copyButton(() => msg.content, "copy-answer"));
    $("log").appendChild(e);
  }
  if (msg.role === "assistant") {
    e.dataset.state = msg.state;
    if (msg.route) e.dataset.route = msg.route.name;
    e.querySelector(".route").textContent = msg.route ? `route: ${msg.route.name} (${msg.route.reason})` : "";
    e.querySelector(".end").textContent = msg.end || "";
  }
  drawAnswer(e.querySelector(".answer"), msg);
  return e;
}

function drawList() {
  const ul = $("chat-list");
  ul.textContent = "";
  for (const c of chats.filter((c) => c.messages.length)) {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    if (c === chat) li.className = "current";
    const open = document.createElement("button");
    open.type = "button"; open.className = "open";
    open.textContent = c.title;
    open.addEventListener("click", () => show(c));
    const del = document.createElement("button");
    del.type = "button"; del.className = "delete";
    del.title = del.ariaLabel = "Delete this conversation";
    del.textContent = "\u00d7";
    del.addEventListener("click", () => remove(c));
    li.append(open, del);
    ul.appendChild(li);
  }
}

function show(c) {
  chat = c;
  $("log").textContent = "";
  for (const m of c.messages) drawMessage(m);
  $("log").scrollTop = $("log").scrollHeight;
  drawList();
  document.body.classList.remove("show-chats");
}

function newChat() {
  if (chat && !chat.messages.length) return show(chat);
  const c = { id: uid("chat-"), title: "New chat", updated: Date.now(), messages: [] };
  chats.unshift(c);
  show(c);
  $("prompt").focus();
}

function remove(c) {
  for (const [id, s] of streams) if (s.chat === c) { if (ws) ws.send(JSON.stringify({ type: "cancel", id })); streams.delete(id); }
  chats = chats.filter((x) => x !== c);
  save();
  if (c === chat) { chat = null; chats.length ? show(chats[0]) : newChat(); } else { drawList(); }
  busy();
}

function busy() {
  const running = [...streams.values()].some((s) => s.chat === chat);
  $("send").disabled = running;
  $("stop").disabled = !running;
}

// ---- the device and cloud state, and the server's sampling defaults (once, into an untouched field) -------

let temperatureTouched = false;
async function refreshHealth() {
  try {
    const h = await (await fetch("/health", { cache: "no-store" })).json();
    const cloud = h.offline ? "offline" : h.cloud ? `cloud ${h.cloud.state}` : "device only";
    $("state").textContent = `device: ${h.model} (${h.in_flight} in flight) \u00b7 ${cloud}`;
    $("state").dataset.cloud = h.cloud ? h.cloud.state : "none";
    const d = h.sampling_defaults;
    if (d) {
      $("sampling-note").textContent = `defaults: temperature ${d.temperature}, top-k ${d.top_k}, top-p ${d.top_p}, ` +
        `min-p ${d.min_p}, repeat penalty ${d.repetition_penalty} (${d.source})`;
      if (!temperatureTouched) $("temperature").value = String(d.temperature);
    }
  } catch (e) {
    $("state").textContent = "gateway unreachable";
    $("state").dataset.cloud = "unknown";
  }
}

// ---- the stream --------------------------------------------------------------------------------------------

// One socket for the page; `ready` resolves once the server said welcome.
function connect() {
  if (ready) return ready;
  ready = new Promise((resolve, reject) => {
    const sock = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/stream");
    ws = sock;
    sock.onopen = () => sock.send(JSON.stringify({ type: "hello", api_key: $("api-key").value }));
    sock.onmessage = (e) => {
      const f = JSON.parse(e.data);
      if (f.type === "welcome") {
        retries = 0;
        status("connected to " + f.model);
        resolve(sock);
      } else {
        onFrame(f);
      }
    };
    sock.onclose = (e) => {
      if (ws !== sock) return;
      ws = null; ready = null;
      reject(new Error("closed"));
      if (e.code === 4401) {
        status("unauthorized: check the API key");
        for (const id of [...streams.keys()]) end(id, "error", "unauthorized");
      } else if (streams.size) {
        reconnect();
      } else {
        status("disconnected");
      }
    };
  });
  ready.catch(() => {});
  return ready;
}

// After a drop (or a reload): open the socket and resume every running stream after the last frame it got.
function reconnect(delay = Math.min(250 * 2 ** retries++, 5000)) {
  status(delay ? `connection lost: reconnecting in ${delay} ms` : "resuming the unfinished answer");
  setTimeout(() => connect().then((sock) => {
    for (const [id, s] of streams) sock.send(JSON.stringify({ type: "resume", id, after: s.msg.lastN }));
  }, () => {}), delay);
}

function onFrame(f) {
  const s = streams.get(f.id);
  if (!s) return;
  const msg = s.msg;
  if (f.type === "error" && f.n === undefined) return end(f.id, "error", f.message);  // not a stream frame
  if (f.n <= msg.lastN) return;  // already shown
  msg.lastN = f.n;
  if (f.type === "start") {
    msg.route = { name: f.route, reason: f.route_reason };
  } else if (f.type === "delta") {
    if (!f.text) return;
    s.first = s.first || performance.now();
    s.last = performance.now();
    s.tokens += (f.token_ids || []).length || 1;
    const runs = msg.runs;
    if (!runs.length || runs[runs.length - 1].source !== f.source) runs.push({ source: f.source, start: msg.content.length });
    msg.content += f.text;
  } else if (f.type === "handoff") {
    msg.handoffs.push({ from: f.from, to: f.to, reason: f.reason, at: msg.content.length });
  } else if (f.type === "finish") {
    const n = f.usage ? f.usage.completion_tokens : 0;  // 0 for a cached answer: its tokens were replayed
    const u = !f.usage ? "" : n || !s.tokens ? `, ${n} tokens` : `, ${s.tokens} tokens replayed`;
    return end(f.id, f.finish_reason === "cancelled" ? "cancelled" : "done", `${f.finish_reason}${u}${stats(s, f)}`);
  } else if (f.type === "error") {
    return end(f.id, "error", `${f.code}: ${f.message}`);
  }
  if (s.chat === chat) {
    drawMessage(msg);
    $("log").scrollTop = $("log").scrollHeight;
  }
  saveSoon();
}

// "· first token 35 ms · 210.4 tok/s · local → cloud · 1 hand-off" (after a reload: the sources only)
function stats(s, f) {
  const sources = s.msg.runs.map((r) => r.source).join(" \u2192 "), hand = (f.handoffs || []).length;
  const tail = `${sources} \u00b7 ${hand} hand-off${hand === 1 ? "" : "s"}`;
  if (!s.first || !s.t0) return sources ? ` \u00b7 ${tail}` : "";
  const rate = s.tokens > 1 && s.last > s.first ? ((s.tokens - 1) * 1000 / (s.last - s.first)).toFixed(1) : "\u2013";
  return ` \u00b7 first token ${Math.round(s.first - s.t0)} ms \u00b7 ${rate} tok/s \u00b7 ${tail}`;
}

function end(id, state, note) {
  const s = streams.get(id);
  if (!s) return;
  streams.delete(id);
  const c = s.chat, msg = s.msg;
  msg.state = state;
  msg.end = note;
  // no answer: the question is forgotten too (both stay on screen until the chat is switched)
  if (state === "error" && !msg.content) c.messages.splice(c.messages.indexOf(msg) - 1, 2);
  if (c === chat) drawMessage(msg);
  save();
  busy();
}

function follow(c, msg, t0) {
  streams.set(msg.id, { chat: c, msg, t0, first: 0, last: 0, tokens: 0 });
}

async function send(question) {
  const c = chat;
  const params = { max_tokens: parseInt($("max-tokens").value, 10) || 256,
                   temperature: Math.max(0, parseFloat($("temperature").value) || 0) };
  const history = c.messages.filter((m) => m.role === "user" || m.state !== "error")
    .map((m) => ({ role: m.role, content: m.content }));
  const user = { id: uid("u"), role: "user", content: question };
  const msg = { id: uid("c"), role: "assistant", content: "", runs: [], handoffs: [], route: null,
                state: "streaming", end: "", lastN: -1 };
  if (!c.messages.length) c.title = question.length > 60 ? question.slice(0, 57) + "\u2026" : question;
  c.messages.push(user, msg);
  c.updated = Date.now();
  chats = [c, ...chats.filter((x) => x !== c)];
  drawMessage(user);
  drawMessage(msg);
  drawList();
  save();
  follow(c, msg, performance.now());
  busy();
  try {
    const sock = await connect();
    sock.send(JSON.stringify({ type: "generate", id: msg.id, messages: [...history, { role: "user", content: question }],
                               params, route: $("route").value }));
  } catch (e) {
    if (streams.has(msg.id) && !ws) end(msg.id, "error", "cannot connect to the gateway");
  }
}

// ---- controls and keyboard shortcuts ----------------------------------------------------------------------

function stop() {
  for (const [id, s] of streams) if (s.chat === chat && ws) ws.send(JSON.stringify({ type: "cancel", id }));
}

function lastAnswer() {
  return [...chat.messages].reverse().find((m) => m.role === "assistant" && m.content);
}

function step(by) {  // the next (1) or previous (-1) conversation in the list
  const list = chats.filter((c) => c.messages.length), i = list.indexOf(chat);
  const next = list[Math.min(list.length - 1, Math.max(0, (i < 0 ? -1 : i) + by))];
  if (next && next !== chat) show(next);
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const q = $("prompt").value.trim();
  if (!q || $("send").disabled) return;
  $("prompt").value = "";
  send(q);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", newChat);
$("toggle-chats").addEventListener("click", () => document.body.classList.toggle("show-chats"));
// The API key is kept for this tab only (sessionStorage): a reload keeps it, closing the tab forgets it.
$("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
$("api-key").addEventListener("change", () => {
  sessionStorage.setItem(KEY_STORE, $("api-key").value);
  if (ws && !streams.size) {  // the next question opens a socket with the new key
    const old = ws;
    ws = null; ready = null;
    old.close();
  }
});
$("temperature").addEventListener("input", () => { temperatureTouched = true; });

// Shortcuts (listed on the page): Esc stops, / focuses the question, Ctrl+Shift+O starts a new chat,
// Ctrl+Shift+C copies the last answer, Alt+Up / Alt+Down go to the previous / next conversation.
document.addEventListener("keydown", (e) => {
  const typing = /^(INPUT|TEXTAREA|SELECT)$/.test(document.activeElement && document.activeElement.tagName);
  const ctrl = e.ctrlKey || e.metaKey, key = e.key.length === 1 ? e.key.toLowerCase() : e.key;
  let handled = true;
  if (key === "Escape" && !$("stop").disabled) stop();
  else if (key === "/" && !typing) $("prompt").focus();
  else if (ctrl && e.shiftKey && key === "o") newChat();
  else if (ctrl && e.shiftKey && key === "c" && lastAnswer()) copy(lastAnswer().content, null);
  else if (e.altKey && (key === "ArrowUp" || key === "ArrowDown")) step(key === "ArrowUp" ? -1 : 1);
  else handled = false;
  if (handled) e.preventDefault();
});

// ---- start: the last conversation, its unfinished answers resumed ------------------------------------------

refreshHealth();
setInterval(refreshHealth, 5000);
if (chats.length) show(chats[0]); else newChat();
for (const c of chats) for (const m of c.messages) if (m.role === "assistant" && m.state === "streaming") follow(c, m, 0);
if (streams.size) { busy(); reconnect(0); }
