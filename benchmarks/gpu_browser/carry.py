"""Pack (here) and unpack (on the GPU machine) what the Node browser harness needs there: a Node
binary, Dawn for Node (npm ``webgpu``: only ``index.js``, ``package.json`` and the linux-x64
``dawn.node`` of its 51 MB tarball), Pyodide's interpreter files, the wheelhouse the offline bundle
installs (ours built from this tree, msgpack, micropip, a pyodide-lock.json) and onnxruntime-web's
WebGPU bundle with the wasm it loads. Large binaries travel xz-compressed: a run carries at most
64 MiB in all (the tracked tree and .whl/ included).

    .venv/bin/python benchmarks/gpu_browser/carry.py pack [--out .nodecarry] [--no-ort]
    python3 benchmarks/gpu_browser/carry.py unpack [--src .nodecarry] [--dest DIR]   (DIR: gpu_browser in the temp folder)

``pack`` needs ``npm`` (it installs ``webgpu`` into a scratch folder: the package cannot go into
web/node_modules, whose lock file the bundle pins), ``web/node_modules`` (``npm ci --prefix web``)
and ``node`` on PATH. Nothing it writes is committed (the folder is git-ignored).
"""

from __future__ import annotations

import argparse
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WEBGPU_NPM = "webgpu@0.6.2"
PYODIDE_FILES = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip", "package.json")
ORT_FILES = ("ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
COMPRESS_OVER = 1 << 20  # files larger than this travel as NAME.xz


def _put(src: Path, dst: Path) -> int:
    """Copy ``src`` to ``dst`` (``dst``.xz when large); returns the bytes written."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.stat().st_size > COMPRESS_OVER:
        out = dst.with_name(dst.name + ".xz")
        with open(src, "rb") as f, lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as g:
            shutil.copyfileobj(f, g, 1 << 22)
        return out.stat().st_size
    shutil.copy2(src, dst)
    return dst.stat().st_size


def pack(out: Path, with_ort: bool = True) -> None:
    sys.path.insert(0, str(ROOT / "web"))
    import build as web_build  # web/build.py: the offline bundle's wheelhouse, the same here

    node = shutil.which("node")
    npm = shutil.which("npm")
    if not node or not npm:
        raise SystemExit("carry.py pack: node and npm must be on PATH")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    sizes = {}
    sizes["node"] = _put(Path(os.path.realpath(node)), out / "bin" / "node")
    with tempfile.TemporaryDirectory(prefix="gpu-browser-npm-") as tmp:
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--ignore-scripts", "--prefix", tmp, WEBGPU_NPM],
                       check=True, stdout=subprocess.DEVNULL)
        pkg = Path(tmp) / "node_modules" / "webgpu"
        for rel in ("index.js", "package.json", "dist/linux-x64/dawn.node"):
            sizes[f"webgpu/{rel}"] = _put(pkg / rel, out / "webgpu" / rel)
    for name in PYODIDE_FILES:
        sizes[f"pyodide/{name}"] = _put(web_build.PYODIDE_NPM / name, out / "pyodide" / name)
    wheels = out / "wheels"
    web_build.build_wheelhouse(wheels)
    sizes["wheels"] = sum(p.stat().st_size for p in wheels.iterdir())
    if with_ort:
        for name in ORT_FILES:
            sizes[f"ort/{name}"] = _put(web_build.ORT_NPM / name, out / "ort" / name)
    for k, v in sizes.items():
        print(f"  {k}: {v / 1e6:.1f} MB")
    print(f"{out}: {sum(sizes.values()) / 2**20:.1f} MiB")


def unpack_file(src: Path, dst: Path) -> Path:
    """``src`` to ``dst``: decompressed when ``src`` is a NAME.xz that ``_put`` wrote, else copied."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.suffix == ".xz":
        with lzma.open(src, "rb") as f, open(dst, "wb") as g:
            shutil.copyfileobj(f, g, 1 << 22)
    else:
        shutil.copy2(src, dst)
    return dst


def unpack(src: Path, dest: Path) -> Path:
    """The carried tree with every NAME.xz decompressed to NAME; bin/node made executable."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in src.rglob("*"):
        if p.is_dir():
            continue
        rel = p.relative_to(src)
        if p.suffix == ".xz":
            target = dest / rel.with_suffix("")
            if target.exists() and target.stat().st_mtime >= p.stat().st_mtime:
                continue  # a warm machine keeps what the last call unpacked
            unpack_file(p, target)
        else:
            unpack_file(p, dest / rel)
    (dest / "bin" / "node").chmod(0o755)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="build the carry folder here")
    p.add_argument("--out", type=Path, default=ROOT / ".nodecarry")
    p.add_argument("--no-ort", action="store_true", help="leave onnxruntime-web out (~7 MB less)")
    u = sub.add_parser("unpack", help="decompress the carry folder (on the GPU machine)")
    u.add_argument("--src", type=Path, default=ROOT / ".nodecarry")
    u.add_argument("--dest", type=Path, default=Path(tempfile.gettempdir()) / "gpu_browser")
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        pack(a.out, with_ort=not a.no_ort)
    else:
        print(unpack(a.src, a.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
