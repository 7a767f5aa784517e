// The browser executor without a browser: Pyodide (from the offline bundle's npm files) in Node,
// with `navigator.gpu` from the npm `webgpu` package (Dawn for Node), so gpudelegate's own
// browser adapter (web/webgpu.py, through Pyodide's `js`) drives a real GPU. The GPU machine has
// no display and no network, and a Chromium there needs ~90 MB of debs carried over several
// calls (benchmarks/README.md); this needs Node, dawn.node and Pyodide.
//
//   node runner.mjs --carry DIR --jobs JOBS.json --out RESULTS.json [--programs DIR]
//
// DIR holds what benchmarks/gpu_browser/carry.py packs: webgpu/ (index.js, package.json,
// dist/linux-x64/dawn.node), pyodide/ (the interpreter files), wheels/ (our wheel, msgpack,
// micropip and the pyodide-lock.json naming them), ort/ (onnxruntime-web's WebGPU bundle).
// JOBS.json: {"dawn_toggles": [...], "steps": [{"name", "kind": "python"|"ort", ...}]}; a
// python step runs its `code` (await allowed) with ARGS bound, as web/app/harness.html does; an
// ort step creates an onnxruntime-web session on the WebGPU EP and runs it, as web/app/ort.html
// does. `fetch("programs/NAME")` reads NAME from --programs, so page code that fetches its
// program runs unchanged. Every step's result (or its error) goes to RESULTS.json.
import { readFileSync, writeFileSync, existsSync } from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const args = process.argv.slice(2);
const opt = {};
for (let i = 0; i < args.length; i += 2) opt[args[i].replace(/^--/, "")] = args[i + 1];
if (args.includes("--help") || !opt.carry || !opt.jobs || !opt.out) {
  console.log("usage: node runner.mjs --carry DIR --jobs JOBS.json --out RESULTS.json [--programs DIR]");
  process.exit(args.includes("--help") ? 0 : 2);
}
const carry = path.resolve(opt.carry);
const programs = path.resolve(opt.programs || ".");
const jobs = JSON.parse(readFileSync(opt.jobs, "utf8"));
const results = { steps: {}, node: process.version };
const save = () => writeFileSync(opt.out, JSON.stringify(results));
const log = (...a) => console.error(`[runner ${(performance.now() / 1000).toFixed(1)} s]`, ...a);

// fetch("programs/NAME") -> the file, as the page's server would answer it.
const realFetch = globalThis.fetch;
globalThis.fetch = async (url, init) => {
  const u = String(url);
  if (u.startsWith("programs/") || u.startsWith("onnx/")) {
    const file = path.join(programs, path.basename(u));
    if (!existsSync(file)) return new Response(null, { status: 404 });
    const bytes = readFileSync(file);
    return new Response(bytes, { headers: { "Content-Length": String(bytes.byteLength) } });
  }
  return realFetch(url, init);
};

async function bootPyodide() {
  const pyo = path.join(carry, "pyodide");
  const wheels = path.join(carry, "wheels");
  const { loadPyodide } = await import(pathToFileURL(path.join(pyo, "pyodide.mjs")).href);
  const t0 = performance.now();
  const py = await loadPyodide({
    indexURL: pyo + path.sep,
    lockFileContents: readFileSync(path.join(wheels, "pyodide-lock.json"), "utf8"),
    packageBaseUrl: wheels + path.sep,
    stdout: (s) => console.error(s),
    stderr: (s) => console.error(s),
  });
  const packages = ["gpudelegate", "msgpack"];
  await py.loadPackage(packages, { messageCallback: () => {} });
  const missing = packages.filter((p) => !(p in py.loadedPackages));
  if (missing.length) throw new Error(`packages missing from the wheelhouse: ${missing.join(", ")}`);
  results.boot_seconds = (performance.now() - t0) / 1000;
  return py;
}

// onnxruntime-web on its WebGPU EP, as web/app/ort.html runs it (same options, same timing:
// each run ends with the output on the CPU).
// onnxruntime-web's threaded wasm keeps tensors in a shared WebAssembly.Memory and hands
// queue.writeBuffer views of it; browsers accept a SharedArrayBuffer there, dawn.node throws
// "Invalid argument". Such views are copied first. Installed at the first ORT step, after our
// executor's steps, so their writeBuffer calls are never wrapped.
function copySharedWrites() {
  const writeBuffer = GPUQueue.prototype.writeBuffer;
  GPUQueue.prototype.writeBuffer = function (buf, off, data, dataOff = 0, size) {
    if (data && data.buffer instanceof SharedArrayBuffer) {
      const el = data.BYTES_PER_ELEMENT || 1;
      const n = size === undefined ? data.byteLength - dataOff * el : size * el;
      const copy = new Uint8Array(n);
      copy.set(new Uint8Array(data.buffer, data.byteOffset + dataOff * el, n));
      return writeBuffer.call(this, buf, off, copy, 0, n);
    }
    return writeBuffer.call(this, buf, off, data, dataOff, size);
  };
}

let ort = null;
async function ortStep(step) {
  if (!ort) {
    copySharedWrites();
    ort = await import(pathToFileURL(path.join(carry, "ort", "ort.webgpu.min.mjs")).href);
    ort.env.wasm.wasmPaths = pathToFileURL(path.join(carry, "ort") + path.sep).href;
    ort.env.wasm.numThreads = 1;
    ort.env.logLevel = "warning";
  }
  const t0 = performance.now();
  const model = readFileSync(path.join(programs, step.model));
  const s = await ort.InferenceSession.create(new Uint8Array(model), {
    executionProviders: [step.ep || "webgpu"], graphOptimizationLevel: "all", logSeverityLevel: 2 });
  const create = (performance.now() - t0) / 1000;
  const out = { create, version: ort.env.versions ? ort.env.versions.web : "", shapes: {} };
  const a = ort.env.webgpu && ort.env.webgpu.adapter && ort.env.webgpu.adapter.info;
  if (a) out.adapter = Object.fromEntries(["vendor", "architecture", "device", "description"].map((k) => [k, a[k]]));
  for (const sh of step.shapes) {
    const feeds = { ids: new ort.Tensor("int32", Int32Array.from(sh.ids.flat()), [sh.B, sh.T]),
                    mask: new ort.Tensor("int32", Int32Array.from(sh.mask.flat()), [sh.B, sh.T]) };
    const once = async () => {
      const t = performance.now();
      const r = await s.run(feeds);
      const emb = r[s.outputNames[0]];
      const data = emb.location === "cpu" ? emb.data : await emb.getData();
      return { seconds: (performance.now() - t) / 1000, data };
    };
    const first = await once();
    const runs = [];
    let last = first;
    for (let i = 0; i < step.runs; i++) { last = await once(); runs.push(last.seconds); }
    out.shapes[`${sh.B}x${sh.T}`] = { first: first.seconds, runs, embedding: Array.from(last.data) };
    log(`ort ${sh.B}x${sh.T}: best ${(Math.min(...runs) * 1e3).toFixed(2)} ms`);
  }
  await s.release();
  return out;
}

// WebGPU as a page has it (set after Pyodide has booted: a `navigator` present at boot makes
// Pyodide take the browser's path and fail with "Failed to import _pyodide_core"): the GPU* classes and constants (GPUBufferUsage, ...) as globals and
// navigator.gpu. Node 20 has no `navigator` (21+ has one without `gpu`).
async function installWebGPU() {
  const webgpu = await import(pathToFileURL(path.join(carry, "webgpu", "index.js")).href);
  Object.assign(globalThis, webgpu.globals);
  const gpu = webgpu.create(jobs.dawn_toggles || []);
  if (typeof globalThis.navigator === "undefined") globalThis.navigator = {};
  Object.defineProperty(globalThis.navigator, "gpu", { value: gpu, configurable: true });
}

let py = null;
try {
  py = await bootPyodide();
  await installWebGPU();
  log(`Pyodide + gpudelegate in ${results.boot_seconds.toFixed(1)} s`);
} catch (e) {
  results.error = `boot: ${e.stack || e}`;
  save();
  process.exit(1);
}
for (const step of jobs.steps) {
  const t0 = performance.now();
  log(`step ${step.name}`);
  try {
    let r;
    if (step.kind === "ort") r = await ortStep(step);
    else {
      py.globals.set("ARGS", py.toPy(step.args ?? null));
      const got = await py.runPythonAsync(step.code);
      r = got && got.toJs ? got.toJs({ dict_converter: Object.fromEntries }) : got;
    }
    results.steps[step.name] = { result: r, seconds: (performance.now() - t0) / 1000 };
  } catch (e) {
    results.steps[step.name] = { error: String(e.message || e).slice(-4000), seconds: (performance.now() - t0) / 1000 };
    log(`step ${step.name} failed: ${String(e.message || e).slice(-600)}`);
  }
  save();
}
save();
log("done");
process.exit(0);
