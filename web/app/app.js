// The demo page's UI thread: talks to worker.js, renders progress, tokens and rankings.
const $ = (id) => document.getElementById(id);
const worker = new Worker(new URL("./worker.js", import.meta.url), { type: "module" });
const pending = new Map();
let nextId = 1;
let programs = [];
let cached = new Set();
let chosen = null;
let loaded = null;

function call(type, args = {}, onEvent = () => {}) {
  const id = nextId++;
  return new Promise((resolve, reject) => {
    pending.set(id, { resolve, reject, onEvent });
    worker.postMessage({ id, type, ...args });
  });
}

worker.onmessage = (ev) => {
  const m = ev.data;
  if (m.type === "status") return setAdapter("pending", m.text);
  if (m.type === "log") return log(m.text);
  const p = pending.get(m.id);
  if (!p) return;
  if (m.type === "result") { pending.delete(m.id); p.resolve(m.result); }
  else if (m.type === "error") { pending.delete(m.id); const e = new Error(m.message); e.detail = m.detail; p.reject(e); }
  else p.onEvent(m);
};
worker.onerror = (e) => fatal("The worker failed to start", e.message || String(e));

function log(text) {
  const el = $("log");
  el.textContent += `[${(performance.now() / 1000).toFixed(1)}s] ${text}\n`;
  el.scrollTop = el.scrollHeight;
}
function fatal(title, detail) {
  const el = $("fatal");
  el.hidden = false;
  el.innerHTML = "";
  const s = document.createElement("strong");
  s.textContent = title;
  el.append(s, document.createTextNode("\n" + detail));
  log(`${title}: ${detail}`);
}
function setAdapter(state, text) {
  $("adapter").className = `adapter ${state}`;
  $("adapter-text").textContent = text;
}
// Decimal megabytes, as export and `gpudelegate inspect` report file sizes (a 97.8e6-byte file is "98 MB").
const mb = (n) => (n / 1e6).toFixed(n < 1e7 ? 1 : 0) + " MB";
const secs = (s) => (s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`);

// Export writes metadata.task; web/build.py copies it (with the model name and the weights:
// demo.weights_summary) into programs/index.json.
const TASKS = {
  "causal-lm": { kind: "chat", desc: "Llama-style chat model, tokens streamed as they are generated" },
  "sentence-embedding": { kind: "similarity", desc: "Sentence embeddings, ranked by cosine similarity" },
};
function describe(entry) {
  const t = TASKS[entry.task] || { kind: "program", desc: "gpudelegate program" };
  const w = entry.weights || {};
  return { ...t, name: entry.model || entry.file, weights: w.label || w.kind || "float32" };
}

// One group per model; its programs are a choice of weights (SmolLM2 with its GGUF's 4-bit blocks
// or with float32 weights), each with its download size. Each group lists its smallest download
// first and that is the one preselected: the 4-bit SmolLM2 (98 MB) rather than float32 (539 MB).
// Chat models come first: the demo's headline, and what the page preselects on start.
function modelGroups() {
  const by = new Map();
  for (const e of programs) {
    const key = e.model || e.file;
    if (!by.has(key)) by.set(key, []);
    by.get(key).push(e);
  }
  const rank = (g) => (describe(g[0]).kind === "chat" ? 0 : 1);
  return [...by.values()].map((g) => g.sort((a, b) => a.bytes - b.bytes)).sort((a, b) => rank(a) - rank(b));
}

function renderModels() {
  const box = $("models");
  box.innerHTML = "";
  if (!programs.length) {
    box.innerHTML = `<div class="model-group" disabled><div class="name">No exported programs in this bundle</div>
      <div class="desc">Run <code>make web</code>: it exports SmolLM2 and MiniLM as <code>make demo</code> does, then builds the bundle.</div></div>`;
    return;
  }
  for (const group of modelGroups()) {
    const d = describe(group[0]);
    const g = document.createElement("div");
    g.className = "model-group";
    g.setAttribute("role", "group");
    g.setAttribute("aria-label", `${d.name} weights`);
    g.innerHTML = `<div class="name"></div><div class="desc"></div><div class="variants"></div>`;
    g.querySelector(".name").textContent = d.name;
    g.querySelector(".desc").textContent = d.desc;
    for (const entry of group) {
      const b = document.createElement("button");
      b.className = "model";
      b.type = "button";
      b.setAttribute("role", "radio");
      b.dataset.file = entry.file;
      b.dataset.weights = (entry.weights || {}).kind || "";
      b.setAttribute("aria-checked", String(chosen === entry));
      b.innerHTML = `<span class="weights"></span><span class="meta"><span class="pill size"></span>${cached.has(entry.file) ? '<span class="pill cached">cached</span>' : ""}</span>`;
      b.querySelector(".weights").textContent = describe(entry).weights;
      b.querySelector(".size").textContent = `${mb(entry.bytes)} download`;
      b.title = entry.file;
      b.onclick = () => { chosen = entry; renderModels(); updateBudget(); };
      g.querySelector(".variants").append(b);
    }
    box.append(g);
  }
  // What "Load model" loads: the model, its weights and the download (or the cached copy).
  $("choice").textContent = chosen ? `Load model: ${describe(chosen).name} · ${describe(chosen).weights} · ${mb(chosen.bytes)}${cached.has(chosen.file) ? " (cached)" : " download"}` : "";
}

function updateBudget() {
  const v = Number($("budget").value);
  const out = $("budget-out");
  if (v >= 100) out.textContent = "all weights resident";
  else if (v === 0) out.textContent = "offload floor (weights stream in)";
  else if (chosen) out.textContent = `floor + ${v}% (weights stream in)`;
  else out.textContent = `${v}%`;
}

// The load phases, in the order they can come (web/app/worker.js, web/demo.py, Session.build):
// the page names the one that runs, so a finished download bar never stands for planning or
// compiling. Short names label the finished steps; `text` is what the progress line says.
const PHASES = {
  cache: { step: "cache", text: "reading the program from Cache Storage" },
  download: { step: "download", text: "downloading (each constant's SHA-256 checked as it arrives)" },
  verify: { step: "verify", text: "decoding and verifying the program (SHA-256 of every constant)" },
  store: { step: "store", text: "saving a copy in Cache Storage" },
  plan: { step: "plan", text: "planning memory, weights and offload" },
  allocate: { step: "allocate", text: "allocating GPU buffers" },
  record: { step: "compile", text: "compiling GPU pipelines and recording the dispatch chain" },
  prepack: { step: "upload", text: "uploading weights to the GPU" },
  ready: { step: "ready", text: "ready" },
};
let phase = null; // {name, li, t0} of the phase running now

function startPhase(name, text) {
  if (phase && phase.name === name) return;
  const now = performance.now();
  if (phase) {
    phase.li.className = "done";
    phase.li.querySelector(".t").textContent = secs((now - phase.t0) / 1000);
  }
  const li = document.createElement("li");
  li.className = name === "ready" ? "done" : "active";
  li.dataset.phase = name;
  li.innerHTML = `<span class="n"></span><span class="t"></span>`;
  li.querySelector(".n").textContent = (PHASES[name] || { step: name }).step;
  $("phases").append(li);
  phase = { name, li, t0: now };
  $("progress").hidden = false;
  $("progress").dataset.phase = name;
  $("progress-label").textContent = text || (PHASES[name] || { text: name }).text;
  // No byte count yet: the bar moves without claiming a fraction (the phase may bring one).
  $("progress").classList.toggle("busy", name !== "ready");
  $("progress-fill").style.width = name === "ready" ? "100%" : "0%";
  $("progress-bytes").textContent = "";
}

function showProgress(name, done, total) {
  startPhase(name);
  $("progress").classList.toggle("busy", !total);
  $("progress-fill").style.width = total ? `${Math.min(100, (100 * done) / total).toFixed(1)}%` : "100%";
  $("progress-bytes").textContent = total ? `${mb(done)} / ${mb(total)}` : "";
}

async function load() {
  if (!chosen) return;
  $("load").disabled = true;
  $("chat-card").hidden = $("sim-card").hidden = true;
  $("fatal").hidden = true;
  $("load-stats").hidden = true;
  $("phases").innerHTML = "";
  phase = null;
  const fraction = Number($("budget").value) / 100;
  const t0 = performance.now();
  try {
    const info = await call("load", { entry: chosen, budgetFraction: fraction }, (m) => {
      if (m.type === "phase") startPhase(m.phase);
      else if (m.type === "progress") showProgress(m.phase, m.done, m.total);
    });
    loaded = { ...info, entry: chosen };
    cached.add(chosen.file);
    renderModels();
    startPhase("ready", `ready — ${describe(chosen).name}, ${(info.weights || {}).label || describe(chosen).weights} weights`);
    $("progress-bytes").textContent = `${secs((performance.now() - t0) / 1000)} total`;
    $("load-stats").hidden = false;
    $("stat-source").textContent = info.source === "cache" ? "Cache Storage (no download)" : "network (now cached)";
    $("stat-download").textContent = info.source === "cache" ? `${mb(info.bytes)} in ${secs(info.downloadSeconds)} (cache read)` :
      `${mb(info.bytes)} in ${secs(info.downloadSeconds)} · ${(info.bytes / 1e6 / Math.max(info.downloadSeconds, 1e-3)).toFixed(0)} MB/s`;
    // The weights that run, by type (what the GPU holds: GGUF blocks stay packed there).
    const w = info.weights || {};
    $("stat-weights").textContent = w.label || "–";
    const types = document.createElement("small");
    types.textContent = Object.entries(w.types || {}).filter(([, n]) => n >= 1e5).map(([t, n]) => `${t} ${mb(n)}`).join(" · ");
    $("stat-weights").append(types);
    $("chat-weights").textContent = w.label ? `${w.label} weights` : "";
    const t = info.timings || {};
    $("stat-load").textContent = `${secs(info.buildSeconds)} (plan ${secs(t.plan || 0)} · compile ${secs(t.record || 0)} · upload ${secs(t.prepack || 0)})`;
    $("stat-resident").textContent = info.offload
      ? `${mb(info.deviceWeightBytes)} of ${mb(info.weightBytes)} (streaming ${info.streamed} weights)`
      : `${mb(info.weightBytes)} (all resident)`;
    log(`loaded ${chosen.file}: ${JSON.stringify(info)}`);
    const kind = info.task || describe(chosen).kind;
    $("chat-card").hidden = kind !== "chat";
    $("sim-card").hidden = kind !== "similarity";
  } catch (e) {
    $("progress").hidden = true;
    fatal(phase ? `Loading failed (${PHASES[phase.name]?.step || phase.name})` : "Loading failed", e.message);
    log(e.detail || e.message);
  } finally {
    $("load").disabled = false;
  }
}

async function generate(ev) {
  ev.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  const out = $("chat-output");
  out.innerHTML = "";
  const you = document.createElement("span");
  you.className = "you";
  you.textContent = `you: ${prompt}`;
  const text = document.createElement("span");
  const cursor = document.createElement("span");
  cursor.className = "cursor";
  out.append(you, text, cursor);
  $("generate").disabled = true;
  try {
    // ?lookahead=host|0|1|2 (benchmarks compare them; read at each click, so a page may change
    // it with history.replaceState): how the greedy loop picks tokens (web/demo.py chat).
    const lookahead = new URLSearchParams(location.search).get("lookahead") || "auto";
    const r = await call("generate", { prompt, maxNewTokens: Number($("max-tokens").value), lookahead }, (m) => {
      if (m.type === "token") text.textContent += m.text;
    });
    $("gen-stats").hidden = false;
    $("stat-prefill").textContent = `${secs(r.prefillSeconds)} · ${r.promptTokens} tokens`;
    // Below one token a second (a software adapter) "0.0 tokens/s" would say nothing: seconds per token.
    const tps = r.tokensPerSecond;
    $("stat-tps").textContent = !(tps > 0) ? "–" : tps >= 1 ? `${tps.toFixed(1)} tokens/s` : `${(1 / tps).toFixed(1)} s per token`;
    $("stat-ntok").textContent = String(r.ids.length);
    out.dataset.ids = JSON.stringify(r.ids);
    out.dataset.lookahead = r.lookahead;  // the greedy loop that ran ("None": picked in the page)
    log(`generated ${r.ids.length} tokens: ${JSON.stringify(r.ids)}`);
  } catch (e) {
    fatal("Generation failed", e.message);
    log(e.detail || e.message);
  } finally {
    cursor.remove();
    $("generate").disabled = false;
  }
}

// A line under the Rank button: why nothing was ranked, or what the ranking left out.
function simMessage(kind, text) {
  const el = $("sim-message");
  el.hidden = !text;
  el.className = `note ${kind}`;
  el.textContent = text || "";
}

async function rank(ev) {
  ev.preventDefault();
  const sentences = $("sentences").value.split("\n").map((s) => s.trim()).filter(Boolean);
  const query = $("query").value.trim();
  // Refused here, at once: an empty list used to run the model on the query alone and show nothing.
  const refuse = !query ? "Nothing to rank against: write a query above." :
    !sentences.length ? "Nothing to rank: write at least one sentence in the box, one per line." : null;
  if (refuse) {
    $("ranking").innerHTML = "";
    $("sim-stats").hidden = true;
    simMessage("warn", refuse);
    return;
  }
  simMessage("", "");
  $("rank").disabled = true;
  try {
    const r = await call("embed", { query, sentences });
    const ol = $("ranking");
    ol.innerHTML = "";
    for (const { sentence, score, tokens, truncated } of r.ranking) {
      const li = document.createElement("li");
      li.innerHTML = `<span class="score"></span><span class="sent"><span class="simbar"></span><span></span></span>`;
      li.querySelector(".score").textContent = score.toFixed(3);
      li.querySelector(".simbar").style.width = `${Math.max(0, score) * 100}%`;
      li.querySelector(".sent span:last-child").textContent = sentence;
      if (truncated) {
        const note = document.createElement("span");
        note.className = "trunc";
        note.textContent = `truncated to ${r.window} of ${tokens} tokens`;
        li.append(note); // below the sentence, outside .sent: its text stays the sentence alone
      }
      ol.append(li);
    }
    const long = r.ranking.filter((x) => x.truncated).length;
    const notes = [];
    if (r.query.truncated) notes.push(`the query (${r.query.tokens} tokens)`);
    if (long) notes.push(`${long} of ${r.ranking.length} sentence${r.ranking.length > 1 ? "s" : ""}`);
    simMessage("info", notes.length ? `Longer than the model's ${r.window}-token window, so only the first ${r.window} tokens were embedded: ${notes.join(" and ")}.` : "");
    $("sim-stats").hidden = false;
    $("stat-embed").textContent = secs(r.seconds);
    $("stat-nsent").textContent = String(sentences.length);
  } catch (e) {
    fatal("Ranking failed", e.message);
    log(e.detail || e.message);
  } finally {
    $("rank").disabled = false;
  }
}

$("load").onclick = load;
$("budget").oninput = updateBudget;
$("chat-form").onsubmit = generate;
$("sim-form").onsubmit = rank;

(async () => {
  try {
    const r = await call("init");
    programs = r.programs;
    cached = new Set(r.cached);
    chosen = (modelGroups()[0] || [null])[0];
    renderModels();
    log(`Python ready in ${r.bootSeconds.toFixed(1)} s`);
    if (r.gpuError) {
      setAdapter("bad", "no WebGPU");
      fatal("WebGPU is not available", r.gpuError);
      return;
    }
    const a = r.adapter;
    setAdapter("ok", `${a.vendor || "GPU"} · ${a.architecture || a.description || "adapter"}${a.is_fallback_adapter ? " (software)" : ""}`);
    $("adapter").title = JSON.stringify(a, null, 1);
    log(`adapter: ${JSON.stringify(a)}`);
    $("load").disabled = !programs.length;
    $("budget").disabled = !programs.length;
    updateBudget();
    document.body.dataset.ready = "1";
  } catch (e) {
    setAdapter("bad", "failed");
    fatal("Starting Python failed", e.message);
  }
})();
