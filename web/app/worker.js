// The demo's Web Worker: Pyodide + gpudelegate + WebGPU live here so the page stays responsive.
// Messages in:  {id, type: "init" | "load" | "generate" | "embed" | "cached", ...}
// Messages out: {id, type: "result" | "error", ...} for each request, plus events:
//   {id, type: "phase", phase}            a load phase starts: "cache" | "download", "verify", "store"
//                                          (here), then demo.load's "plan", "allocate", "record", "prepack"
//   {id, type: "progress", phase, done, total}   bytes within the phase ("download", "verify", "prepack")
//   {id, type: "token", text}             a generated piece of text
import { bootPyodide } from "./boot.mjs";

const CACHE_NAME = "gpudelegate-programs-v1";
let py = null;
let demo = null;

const post = (m) => self.postMessage(m);

function toJs(x) {
  return x && typeof x.toJs === "function" ? x.toJs({ dict_converter: Object.fromEntries, create_pyproxies: false }) : x;
}

function cacheKey(entry) {
  // The file's size and mtime are part of the key: a re-exported program is downloaded again.
  return new URL(`programs/${entry.file}?v=${entry.mtime}-${entry.bytes}`, self.location.href).href;
}

async function cachedFiles(entries) {
  if (!self.caches) return [];
  const cache = await caches.open(CACHE_NAME);
  const hits = [];
  for (const e of entries) if (await cache.match(cacheKey(e))) hits.push(e.file);
  return hits;
}

// Bytes between two hash steps of the Python checker (web/loader.py HASH_PIECE): each step copies
// this much into the WebAssembly heap and hashes it, so calls across the bridge stay few.
const HASH_STEP = 4 << 20;

// Fetch a program file, from Cache Storage when it is there (no download), else from the server
// with progress, then store it. Every byte goes through a Python checker (demo.download ->
// loader.Download) as it arrives: the header and document are decoded as soon as they are there,
// each constant's SHA-256 key is checked as its byte range completes, so a corrupt download or a
// corrupt cached copy raises a PayloadError naming the constant before anything reaches the GPU
// (a corrupt cached copy is deleted, so the next load downloads it again). Returns the whole file
// as one Uint8Array (never copied again: the GPU gets typed-array views of it) and the checker,
// whose program() is what demo.load runs.
async function fetchProgram(entry, id) {
  const url = new URL(`programs/${entry.file}`, self.location.href).href;
  const key = cacheKey(entry);
  const cache = self.caches ? await caches.open(CACHE_NAME) : null;
  const t0 = performance.now();
  const phase = (name) => post({ id, type: "phase", phase: name });
  if (cache) {
    const hit = await cache.match(key);
    if (hit) {
      phase("cache");
      const bytes = new Uint8Array(await hit.arrayBuffer());
      const check = demo.download(bytes, bytes.byteLength);
      try {
        phase("verify");
        check.verify_all((done, total) => post({ id, type: "progress", phase: "verify", done, total }));
      } catch (e) {
        check.destroy();
        await cache.delete(key);
        throw new Error(`${e.message}\n(${entry.file}: the copy in Cache Storage is corrupt and was deleted; load again to download it)`);
      }
      return { bytes, check, source: "cache", seconds: (performance.now() - t0) / 1000 };
    }
    for (const req of await cache.keys()) if (req.url.startsWith(url + "?v=")) await cache.delete(req);
  }
  phase("download");
  const resp = await fetch(url);
  if (!resp.ok) throw new Error(`GET ${url}: HTTP ${resp.status}`);
  const total = Number(resp.headers.get("Content-Length")) || entry.bytes;
  const bytes = new Uint8Array(total);
  const check = demo.download(bytes, total);
  let got = 0;
  let checked = 0;
  let last = 0;
  const reader = resp.body.getReader();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      if (got + value.byteLength > total) throw new Error(`${url}: more bytes than its Content-Length ${total}`);
      bytes.set(value, got);
      got += value.byteLength;
      if (got - checked >= HASH_STEP) checked = check.advance(got);
      const now = performance.now();
      if (now - last > 50 || got === total) {
        post({ id, type: "progress", phase: "download", done: got, total });
        last = now;
      }
    }
    if (got !== total) throw new Error(`${url}: got ${got} of ${total} bytes (connection cut?)`);
    // Constants were hashed as their bytes arrived; the last piece (up to HASH_STEP) is checked
    // here, after the download bar reached 100%, as its own phase.
    phase("verify");
    check.advance(got);
    post({ id, type: "progress", phase: "verify", done: got, total });
  } catch (e) {
    check.destroy();
    reader.cancel().catch(() => {});
    throw e;
  }
  const seconds = (performance.now() - t0) / 1000;
  if (cache) {
    phase("store");
    try {
      await cache.put(key, new Response(bytes, { headers: { "Content-Type": "application/octet-stream" } }));
    } catch (e) {
      post({ type: "log", text: `could not cache ${entry.file}: ${e.message}` });
    }
  }
  return { bytes, check, source: "network", seconds };
}

const handlers = {
  async init() {
    py = await bootPyodide({ onStatus: (text) => post({ type: "status", text }) });
    demo = py.pyimport("gpudelegate.web.demo");
    const index = await (await fetch(new URL("programs/index.json", self.location.href))).json().catch(() => ({ programs: [] }));
    let adapter = null;
    let gpuError = null;
    try {
      adapter = toJs(await demo.init_gpu());
    } catch (e) {
      const lines = (e.message || String(e)).split("\n");
      const at = lines.findLastIndex((l) => /^[\w.]+(Error|Exception): /.test(l));
      gpuError = (at >= 0 ? lines.slice(at).join("\n") : lines.filter((l) => l.trim()).pop()).replace(/^[\w.]+\.(\w+: )/, "$1").trim();
    }
    const cached = await cachedFiles(index.programs || []);
    return { adapter, gpuError, programs: index.programs || [], cached, bootSeconds: py.bootSeconds };
  },

  async load({ id, entry, budgetFraction }) {
    const got = await fetchProgram(entry, id);
    const progress = (done, total) => post({ id, type: "progress", phase: "prepack", done, total });
    const phase = (name) => post({ id, type: "phase", phase: name });
    try {
      const info = toJs(await demo.load(entry.file, got.check, budgetFraction ?? 1, progress, phase));
      return { ...info, source: got.source, downloadSeconds: got.seconds, bytes: got.bytes.byteLength };
    } finally {
      got.check.destroy();
    }
  },

  async generate({ id, prompt, maxNewTokens, lookahead }) {
    const onToken = (text) => post({ id, type: "token", text });
    return toJs(await demo.chat(prompt, maxNewTokens, onToken, lookahead || "auto"));
  },

  async embed({ query, sentences }) {
    return toJs(await demo.rank(query, sentences));
  },

};

self.onmessage = async (ev) => {
  const msg = ev.data;
  try {
    const result = await handlers[msg.type](msg);
    post({ id: msg.id, type: "result", result });
  } catch (e) {
    // Python errors carry the traceback; the message a person needs starts at the last
    // "SomethingError: ..." line (it may span several lines, e.g. a WebGPU validation message).
    const text = e && e.message ? e.message : String(e);
    const lines = text.split("\n");
    let at = -1;
    lines.forEach((l, i) => { if (/^[\w.]+(Error|Exception): /.test(l)) at = i; });
    const message = at >= 0 ? lines.slice(at).join("\n").replace(/^[\w.]+\.(\w+: )/, "$1").trim() : text.trim();
    post({ id: msg.id, type: "error", message, detail: text });
  }
};
