// epic-rag demo page. Plain DOM: every piece of document or model text goes in through textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {history: [], controller: null, info: null, ingestReady: false, pollTimer: null};

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function apiKey() { return sessionStorage.getItem("epic-api-key") || ""; }

async function api(path, opts = {}) {
  const headers = Object.assign({}, opts.headers || {});
  if (apiKey()) headers["Authorization"] = "Bearer " + apiKey();
  const resp = await fetch(path, Object.assign({}, opts, {headers}));
  if (resp.status === 401) $("key-box").hidden = false;
  return resp;
}

async function errorText(resp) {
  try {
    const j = await resp.json();
    if (j && j.error && j.error.message) return j.error.message;
  } catch (e) { /* not JSON */ }
  return "HTTP " + resp.status;
}

// ------------------------------------------------------------------ status and documents
async function loadInfo() {
  try {
    const r = await fetch("/healthz");
    state.info = await r.json();
  } catch (e) {
    $("ingest-text").textContent = "server unreachable";
    return;
  }
  const info = state.info;
  $("model").textContent = info.model;
  $("key-box").hidden = !info.auth_required;
  const sel = $("policy");
  if (!sel.options.length) {
    for (const p of info.policies) {
      const o = el("option", null, p);
      o.value = p;
      if (p === info.default_policy) o.selected = true;
      sel.appendChild(o);
    }
    $("topk").value = info.top_k;
    $("topk").max = info.max_top_k;
    $("maxtok").value = info.default_max_tokens;
    $("maxtok").max = info.max_tokens_limit;
  }
}

function showProgress(st) {
  const bar = $("ingest-bar");
  const total = Math.max(st.chunks, 1);
  let text;
  if (!st.engine) {
    text = "loading the engine…";
    bar.removeAttribute("value");
  } else if (st.state === "ready") {
    text = `${st.documents} documents · ${st.compiled}/${st.chunks} chunks compiled`;
    if (st.refined < st.compiled) text += ` · ${st.refined} refined behind their neighbours`;
    bar.value = 1;
  } else {
    const phase = st.state === "compiling" ? "compiling" : "indexing";
    text = `${phase}: ${st.embedded}/${st.chunks} embedded, ${st.compiled}/${st.chunks} compiled`;
    bar.value = st.compiled / total;
  }
  if (st.errors && st.errors.length) text += ` · ${st.errors.length} problem(s)`;
  $("ingest-text").textContent = text;
  $("ingest").title = (st.errors || []).join("\n");
  state.ingestReady = st.engine && st.state === "ready";
}

async function refreshDocs() {
  let r;
  try { r = await api("/api/documents"); } catch (e) { return; }
  if (!r.ok) { $("ingest-text").textContent = await errorText(r); return; }
  const data = await r.json();
  showProgress(Object.assign({engine: state.info && state.info.status === "ok"}, data.status));
  const list = $("doc-list");
  list.replaceChildren();
  for (const d of data.documents) {
    const li = el("li", "doc");
    const name = el("span", "doc-name", d.name);
    name.title = `${d.source} · ${d.chars} characters`;
    const meta = el("span", "doc-meta " + d.state,
      d.state === "ready" ? `${d.chunks} chunk${d.chunks === 1 ? "" : "s"}` :
      d.state === "error" ? "error" : `${d.state} ${d.compiled}/${d.chunks}`);
    if (d.error) meta.title = d.error;
    const del = el("button", "del", "×");
    del.type = "button";
    del.title = "delete " + d.name;
    del.setAttribute("aria-label", "delete " + d.name);
    del.addEventListener("click", () => deleteDoc(d.name));
    li.append(name, meta, del);
    list.appendChild(li);
  }
  $("doc-count").textContent = `(${data.documents.length})`;
}

async function deleteDoc(name) {
  if (!confirm(`Delete ${name} from the corpus?`)) return;
  const r = await api("/api/documents/" + encodeURIComponent(name), {method: "DELETE"});
  $("upload-msg").textContent = r.ok ? `deleted ${name}` : await errorText(r);
  poll();
}

async function upload(ev) {
  ev.preventDefault();
  const f = $("upload-file").files[0];
  if (!f) { $("upload-msg").textContent = "choose a file first"; return; }
  if (state.info && f.size > state.info.max_upload_bytes) {
    $("upload-msg").textContent = `file is larger than the ${state.info.max_upload_bytes}-byte limit`;
    return;
  }
  const fd = new FormData();
  fd.append("file", f, f.name);
  $("upload-msg").textContent = "uploading…";
  const r = await api("/api/documents", {method: "POST", body: fd});
  if (r.ok) {
    const j = await r.json();
    $("upload-msg").textContent = `${j.document.name}: indexing and compiling in the background`;
    $("upload-file").value = "";
  } else {
    $("upload-msg").textContent = "upload refused: " + await errorText(r);
  }
  poll();   // follow the new document's progress at the fast rate
}

async function poll() {
  clearTimeout(state.pollTimer);
  await loadInfo();
  await refreshDocs();
  state.pollTimer = setTimeout(poll, state.ingestReady ? 5000 : 1000);
}

// ------------------------------------------------------------------ chat
function renderSources(box, sources) {
  box.replaceChildren();
  if (!sources || !sources.length) {
    box.appendChild(el("div", "muted", "no documents used (retrieval off or empty corpus)"));
    return;
  }
  box.appendChild(el("div", "sources-title", "Sources"));
  for (const s of sources) {
    const d = el("details", "source");
    const sum = el("summary");
    sum.appendChild(el("span", "cite", `[${s.n}]`));
    sum.appendChild(el("span", "src-name", ` ${s.doc} #${s.index}`));
    const bits = [];
    if (s.score !== null && s.score !== undefined) bits.push(`score ${s.score.toFixed(3)}`);
    if (s.tokens) bits.push(`${s.tokens} tok`);
    bits.push(s.compiled ? "compiled" : "compiled on the fly");
    sum.appendChild(el("span", "muted", " · " + bits.join(" · ")));
    d.appendChild(sum);
    d.appendChild(el("pre", "src-text", s.text));
    box.appendChild(d);
  }
}

function renderStats(box, e, finish, ms) {
  box.replaceChildren();
  const items = [
    ["policy", e.policy],
    ["TTFT", `${(e.ttft_s * 1000).toFixed(0)} ms`],
    ["linked", `${e.linked_tokens} tok`],
    ["recomputed", `${e.recomputed_tokens} tok`],
    ["chunks", `${e.chunk_hits} hit / ${e.chunk_misses} miss`],
    ["total", `${(ms / 1000).toFixed(2)} s`],
  ];
  for (const [k, v] of items) {
    const s = el("span", "stat");
    s.appendChild(el("span", "k", k + " "));
    s.appendChild(el("span", "v", v));
    box.appendChild(s);
  }
  if (finish === "length") box.appendChild(el("span", "stat muted", "(cut at max tokens)"));
}

function addBubble(role, text) {
  $("welcome") && $("welcome").remove();
  const b = el("div", "bubble " + role);
  b.appendChild(el("div", "role", role === "user" ? "You" : "Assistant"));
  const body = el("div", "text", text);
  b.appendChild(body);
  $("messages").appendChild(b);
  b.scrollIntoView({block: "end"});
  return {bubble: b, body};
}

function setBusy(busy) {
  $("ask").disabled = busy;
  $("stop").disabled = !busy;
}

async function ask(messages, opts) {
  const {bubble, body} = addBubble("assistant", "");
  if (opts.label) bubble.querySelector(".role").textContent = "Assistant · " + opts.label;
  bubble.classList.add("streaming");
  const stats = el("div", "stats");
  const sources = el("div", "sources");
  bubble.append(stats, sources);
  const req = {
    model: state.info ? state.info.model : undefined, messages, stream: true,
    policy: opts.policy, top_k: opts.topK, max_tokens: opts.maxTokens, use_retrieval: opts.retrieval,
  };
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let answer = "";
  let finished = false;
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(req),
      signal: controller.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") { finished = true; continue; }
          const j = JSON.parse(data);
          if (j.error) throw new Error(j.error.message);
          const c = j.choices && j.choices[0];
          if (j.epic && j.epic.sources && !c?.finish_reason) renderSources(sources, j.epic.sources);
          if (c && c.delta && c.delta.content) {
            answer += c.delta.content;
            body.textContent = answer;
            bubble.scrollIntoView({block: "end"});
          }
          if (c && c.finish_reason && j.epic) renderStats(stats, j.epic, c.finish_reason, performance.now() - t0);
        }
      }
    }
    if (!finished) throw new Error("the stream ended early");
    bubble.classList.add("done");
    addReask(bubble, messages, opts);
    return answer;
  } catch (e) {
    const aborted = e.name === "AbortError";
    bubble.appendChild(el("div", aborted ? "muted" : "error", aborted ? "stopped" : "error: " + e.message));
    return null;
  } finally {
    bubble.classList.remove("streaming");
    state.controller = null;
    setBusy(false);
  }
}

function addReask(bubble, messages, opts) {
  const row = el("div", "reask");
  row.appendChild(el("span", "muted", "Ask again with: "));
  for (const p of (state.info ? state.info.policies : [])) {
    if (p === opts.policy) continue;
    const b = el("button", "link", p);
    b.type = "button";
    b.addEventListener("click", () => ask(messages, Object.assign({}, opts, {policy: p, label: p})));
    row.appendChild(b);
  }
  bubble.appendChild(row);
}

async function onAsk(ev) {
  ev.preventDefault();
  if (state.controller) return;
  const q = $("question").value.trim();
  if (!q) return;
  $("question").value = "";
  addBubble("user", q);
  const messages = state.history.concat([{role: "user", content: q}]);
  const opts = {
    policy: $("policy").value, topK: parseInt($("topk").value, 10), maxTokens: parseInt($("maxtok").value, 10),
    retrieval: $("retrieval").checked,
  };
  const answer = await ask(messages, opts);
  if (answer !== null) state.history = messages.concat([{role: "assistant", content: answer}]).slice(-12);
}

function init() {
  $("api-key").value = apiKey();
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("epic-api-key", $("api-key").value);
    poll();
  });
  $("ask-form").addEventListener("submit", onAsk);
  $("question").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask-form").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => { state.history = []; $("messages").replaceChildren(); });
  $("upload-form").addEventListener("submit", upload);
  poll();
}

init();
