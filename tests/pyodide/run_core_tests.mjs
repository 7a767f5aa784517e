// Run gpudelegate's pure-core unit tests inside Pyodide (Node), fully offline.
//
//   node tests/pyodide/run_core_tests.mjs --wheelhouse DIR [--repo DIR] [--] pytest-args...
//
// The wheelhouse (web/build.py --wheelhouse DIR --test) holds our wheel, msgpack's emscripten
// wheel, pytest and hypothesis with their pure dependencies, and a pyodide-lock.json naming them.
// Test sources are copied into Pyodide's in-memory file system (not mounted), so nothing the run
// writes (caches, hypothesis database) lands in the repository. The last line printed is a JSON
// summary that tests/test_pyodide_core.py parses; the exit code is pytest's.
import { readFileSync, readdirSync, statSync, existsSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
let repo = path.resolve(here, "..", "..");
let wheelhouse = null;
const pytestArgs = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === "--wheelhouse") wheelhouse = path.resolve(args[++i]);
  else if (args[i] === "--repo") repo = path.resolve(args[++i]);
  else if (args[i] === "--") pytestArgs.push(...args.slice(i + 1)), (i = args.length);
  else pytestArgs.push(args[i]);
}
if (!wheelhouse) {
  console.error("usage: run_core_tests.mjs --wheelhouse DIR [--repo DIR] [pytest args]");
  process.exit(2);
}
const pyodideDir = path.join(repo, "web", "node_modules", "pyodide");
if (!existsSync(pyodideDir)) {
  console.error(`${pyodideDir} is missing: run \`npm ci --prefix web\` (make setup does it)`);
  process.exit(2);
}
const lockPath = path.join(wheelhouse, "pyodide-lock.json");
const lock = JSON.parse(readFileSync(lockPath, "utf8"));

const { loadPyodide } = await import(path.join(pyodideDir, "pyodide.mjs"));
const t0 = performance.now();
const pyodide = await loadPyodide({
  indexURL: pyodideDir + path.sep,
  lockFileContents: JSON.stringify(lock),
  packageBaseUrl: wheelhouse + path.sep,
  stdout: (s) => console.log(s),
  stderr: (s) => console.error(s),
});
const tLoad = performance.now();
const wanted = Object.keys(lock.packages);
await pyodide.loadPackage(wanted, { messageCallback: () => {} });
// loadPackage only logs a missing package: check what actually got installed.
const missing = wanted.filter((n) => !(n in pyodide.loadedPackages));
if (missing.length) {
  console.error(`packages not installed from ${lockPath}: ${missing.join(", ")}`);
  process.exit(3);
}
const tPkgs = performance.now();

// Copy tests/ (Python sources, minus the browser and node-side folders) and pyproject.toml (pytest
// markers and options) into MEMFS.
function copyTree(src, dst) {
  pyodide.FS.mkdirTree(dst);
  for (const name of readdirSync(src)) {
    if (["browser", "pyodide", "__pycache__"].includes(name)) continue;
    const s = path.join(src, name);
    const st = statSync(s);
    if (st.isDirectory()) copyTree(s, `${dst}/${name}`);
    else if (name.endsWith(".py") || name.endsWith(".json") || name.endsWith(".txt"))
      pyodide.FS.writeFile(`${dst}/${name}`, readFileSync(s));
  }
}
copyTree(path.join(repo, "tests"), "/work/tests");
pyodide.FS.writeFile("/work/pyproject.toml", readFileSync(path.join(repo, "pyproject.toml")));

pyodide.globals.set("PYTEST_ARGS", pyodide.toPy(pytestArgs));
let result;
try {
  result = await pyodide.runPythonAsync(`
import importlib.util, json, os, sys
os.chdir("/work")
# The point of running here: the core must work where numpy, torch, wgpu and cupy cannot exist.
present = [m for m in ("numpy", "torch", "wgpu", "cupy") if importlib.util.find_spec(m) is not None]
import gpudelegate
env = {"platform": sys.platform, "python": sys.version.split()[0],
       "gpudelegate": gpudelegate.__file__, "heavy_modules_present": present}
# Every pure module must import here (a numpy import anywhere in the core fails on this line).
# Skipped: the desktop/export subpackages, and the CPython-only bundle builder.
import pkgutil, importlib, traceback
SKIP = ("gpudelegate.native", "gpudelegate.export", "gpudelegate.web.build")
modules, import_errors = [], {}
for m in pkgutil.walk_packages(gpudelegate.__path__, "gpudelegate.", onerror=lambda n: None):
    if m.name.startswith(SKIP):
        continue
    try:
        importlib.import_module(m.name)
        modules.append(m.name)
    except Exception as e:
        import_errors[m.name] = f"{type(e).__name__}: {e}"
# What the browser runtime needs: the shared WebGPU executor and lowering (gpudelegate.webgpu), the
# browser adapter and the download checker. One missing from the wheel is an import error too.
for name in ("gpudelegate.webgpu.executor", "gpudelegate.webgpu.lowering", "gpudelegate.webgpu.device",
             "gpudelegate.web.webgpu", "gpudelegate.web.loader", "gpudelegate.web.demo"):
    if name not in modules and name not in import_errors:
        import_errors[name] = "not in the wheel (pyproject.toml packages / web/build.py)"
env["modules_imported"] = modules
env["import_errors"] = import_errors
if sys.platform != "emscripten" or present:
    code = 4
else:
    import pytest
    try:  # wasm is several times slower than CPython: per-example deadlines would flake here
        from hypothesis import settings
        settings.register_profile("pyodide", deadline=None)
        settings.load_profile("pyodide")
    except ImportError:
        pass
    code = int(pytest.main(["-p", "no:cacheprovider", "-q", "-rfE", *PYTEST_ARGS]))
    leaked = [m for m in ("numpy", "torch", "wgpu", "cupy") if m in sys.modules]
    env["imported_during_tests"] = leaked
    if leaked and code == 0:
        code = 4
env["exit_code"] = code
json.dumps(env)
`);
} catch (e) {
  // Print the Python traceback only (Node would also dump a line of minified pyodide.asm.mjs).
  console.error(e.message);
  process.exit(5);
}
const tRun = performance.now();
const summary = JSON.parse(result);
summary.seconds = {
  load_pyodide: +((tLoad - t0) / 1000).toFixed(2),
  load_packages: +((tPkgs - tLoad) / 1000).toFixed(2),
  tests: +((tRun - tPkgs) / 1000).toFixed(2),
};
console.log("PYODIDE_SUMMARY " + JSON.stringify(summary));
process.exit(summary.exit_code);
