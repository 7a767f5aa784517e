"""Serve the offline bundle (web/dist) on 127.0.0.1 only.

Headers: cross-origin isolation (COOP/COEP: onnxruntime-web's wasm threads need
SharedArrayBuffer) and ``Cache-Control: no-cache`` (the wheel's name does not change with its
content; a stale cached wheel would fail the lock file's sha256 check). The demo's weight cache is
the page's Cache Storage, which these headers do not affect.

    python web/serve.py [--dist web/dist] [--port 8000]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
from pathlib import Path

TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
         ".json": "application/json", ".whl": "application/zip", ".gdp": "application/octet-stream",
         ".zip": "application/zip", ".onnx": "application/octet-stream"}


class Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, **TYPES}

    def end_headers(self):
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        self.send_header("Cache-Control", "no-cache")
        super().end_headers()

    def log_message(self, fmt, *args):  # quiet by default; tests read the page, not the log
        if getattr(self.server, "verbose", False):
            super().log_message(fmt, *args)


class BundleServer:
    """The bundle server as a context manager, for tests: ``with BundleServer(dist) as url: ...``"""

    def __init__(self, dist: Path, port: int = 0, verbose: bool = False):
        handler = functools.partial(Handler, directory=str(dist))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.httpd.verbose = verbose
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="serve the gpudelegate browser bundle on 127.0.0.1")
    ap.add_argument("--dist", type=Path, default=Path(__file__).resolve().parent / "dist")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args(argv)
    if not (a.dist / "index.html").exists():
        print(f"{a.dist}/index.html is missing: run `make web` first", file=sys.stderr)
        return 1
    srv = BundleServer(a.dist, a.port, verbose=True)
    print(f"serving {a.dist} at {srv.url} (Ctrl-C stops)")
    try:
        srv.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
