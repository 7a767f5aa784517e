// Start Pyodide from this bundle (never from a CDN) and install gpudelegate + msgpack from our
// own lock file. Used by the demo's worker and by the test harness page.
//
// loadPyodide needs an absolute lockFileURL (a relative one fails with "Invalid base URL"), and
// loadPackage of a package the lock does not know only logs: both are checked here.
export async function bootPyodide({ packages = ["gpudelegate", "msgpack"], onStatus = () => {} } = {}) {
  const base = new URL("./pyodide/", import.meta.url);
  onStatus("starting Python (Pyodide)");
  const { loadPyodide } = await import(new URL("pyodide.mjs", base).href);
  const t0 = performance.now();
  const pyodide = await loadPyodide({
    indexURL: base.href,
    lockFileURL: new URL("pyodide-lock.json", base).href,
    packageBaseUrl: base.href,
  });
  onStatus("installing gpudelegate");
  await pyodide.loadPackage(packages, { messageCallback: () => {} });
  const missing = packages.filter((p) => !(p in pyodide.loadedPackages));
  if (missing.length) throw new Error(`packages missing from the bundle: ${missing.join(", ")}`);
  pyodide.bootSeconds = (performance.now() - t0) / 1000;
  return pyodide;
}
