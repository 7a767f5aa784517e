"""The ``gpudelegate`` command line: inspect, run, export, devices."""

from __future__ import annotations

import argparse
import sys
import time


def _positive_int(s: str) -> int:
    n = int(s)
    if n < 1:
        raise ValueError(s)
    return n


_positive_int.__name__ = "positive integer"  # argparse names the type in its error message


def _parse_budget(s: str) -> int:
    """'300MB', '1.5GiB', '123456' -> bytes."""
    units = {"k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
             "g": 1e9, "gb": 1e9, "gib": 1 << 30, "b": 1}
    t = s.strip().lower()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * units[u])
    return int(t)


def cmd_inspect(a) -> int:
    from . import load
    from .inspect import describe, format_report

    prog = load(a.file)  # a missing file or a directory is a PayloadError naming it
    print(format_report(describe(prog, weight_budget=a.budget, file_size=prog.source_file[1][2]
                                 if getattr(prog, "source_file", None) else _file_size(a.file))))
    return 0


def _file_size(path) -> int:
    import os

    return os.path.getsize(path)


def _npz_inputs(path: str, sig: dict, method: str):
    """The arrays of an .npz matched to the method's inputs by name (``np.savez(f, ids=..,
    mask=..)``); unnamed inputs are ``arr_0``, ``arr_1``... as ``np.savez(f, a, b)`` names them."""
    import zipfile

    import numpy as np

    from .errors import InputError

    names = [t["name"] or f"arr_{i}" for i, t in enumerate(sig["inputs"])]
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InputError(f"--inputs {path}: cannot read it as an .npz ({why})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise InputError(f"--inputs {path}: an .npy array, not an .npz; save the inputs with "
                         f"np.savez(path, {', '.join(f'{n}=...' for n in names)})")
    with data:
        got = list(data.files)
        if sorted(got) != sorted(names):
            missing = [n for n in names if n not in got]
            extra = [n for n in got if n not in names]
            raise InputError(f"--inputs {path}: arrays are matched to {method}'s inputs by name; expected "
                             f"{names}, the file has {got}" + (f" (missing {missing})" if missing else "")
                             + (f" (not inputs: {extra})" if extra else "")
                             + f"; save them with np.savez(path, {', '.join(f'{n}=...' for n in names)})")
        try:
            return {n: data[n] for n in names}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise InputError(f"--inputs {path}: cannot read its arrays ({e})") from None


def _random_inputs(sig, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    xs = []
    for t in sig["inputs"]:
        shape, dt = t["shape"], t["dtype"]
        if dt == "int32":
            xs.append(rng.integers(0, 2, size=shape).astype(np.int32))
        elif dt == "bool":
            xs.append(rng.random(shape) > 0.3)
        else:
            xs.append(rng.standard_normal(shape).astype(dt))
    return xs


def cmd_run(a) -> int:
    try:
        import numpy as np
    except ImportError:
        print("gpudelegate run: needs numpy (host arrays, random inputs, --inputs .npz): "
              "pip install 'gpudelegate[native]' (or [wgpu] / [cuda], which include it)", file=sys.stderr)
        return 2

    from . import load
    from .environment import Environment

    opts = {"profile": True} if a.profile else {}
    with Environment() as env:
        t0 = time.perf_counter()
        prog = load(a.file)
        t1 = time.perf_counter()
        s = env.session(prog, device=a.device, weight_budget=a.budget, precision=a.precision, **opts)
        t2 = time.perf_counter()
        if a.device == "auto" and env.auto_skipped:
            print(f"auto: passed over {'; '.join(env.auto_skipped)}")
        method = a.method or s.methods[0]
        sig = s.signature(method)
        if a.inputs:
            xs = _npz_inputs(a.inputs, sig, method)
        else:
            if any(t["dtype"] == "int32" for t in sig["inputs"]):
                print("inputs: random (int32 inputs are 0/1); give real ones with --inputs FILE.npz")
            xs = _random_inputs(sig, a.seed)
        s.run(method, xs)  # warm-up (pipelines, first-use allocations)
        times = []
        for _ in range(a.repeat):
            r0 = time.perf_counter()
            outs = s.run(method, xs)
            times.append(time.perf_counter() - r0)
        tm = s.timings
        start = max(0.0, (t2 - t1) - tm.get("build", 0.0))
        print(f"device: {s.device}  ready in {t2 - t0:.3f}s: load {t1 - t0:.3f}s, device start {start:.3f}s, "
              f"session build {tm.get('build', 0.0):.3f}s ("
              + ", ".join(f"{k} {tm[k]:.3f}s" for k in ("plan", "allocate", "record", "prepack") if k in tm) + ")")
        print(f"method {method}: median {sorted(times)[len(times) // 2] * 1e3:.2f} ms over {a.repeat} runs")
        for t, o in zip(sig["outputs"], outs):
            o = np.asarray(o)
            print(f"  output {t['name'] or '?'} {o.dtype}{list(o.shape)}: mean {o.astype(np.float64).mean():.6g} "
                  f"first {o.reshape(-1)[:5].tolist()}")
        prof = getattr(s.executor, "last_profile", None)
        if a.profile:
            if not prof:
                print("profile: this device has no timestamp queries; no per-op GPU times")
            else:
                total = sum(t for _, _, t in prof) or 1e-12
                agg = {}
                for op, _node, t in prof:
                    agg[op] = agg.get(op, 0.0) + t
                print(f"per-op GPU time (total {total * 1e3:.3f} ms):")
                for op, t in sorted(agg.items(), key=lambda kv: -kv[1]):
                    print(f"  {op:<14} {t * 1e3:9.3f} ms  {100 * t / total:5.1f}%")
    return 0


def cmd_devices(a) -> int:
    from .environment import AUTO_ORDER, Environment
    from .errors import DeviceError

    with Environment() as env:
        for kind in AUTO_ORDER:
            try:
                ctx = env.context(kind)
            except DeviceError as e:
                print(f"{kind:<10} unavailable: {e}")
                continue
            info = dict(ctx.info())
            # WebGPU backends (wgpu-native, Dawn) list what their kernels may use on separate lines.
            feats = info.pop("features", None)
            configs = info.pop("subgroup_matrix_configs", None)
            print(f"{kind:<10} available  {info}")
            if feats is not None:
                print(f"{'':<10} features: {', '.join(feats) or '(none)'}")
            if configs is not None:
                shown = ", ".join(f"{c['component']}x{c['component']}->{c['result']} {c['M']}x{c['N']}x{c['K']}"
                                  for c in configs)
                print(f"{'':<10} subgroup-matrix configs: {shown or '(none)'}")
    return 0


def cmd_export(argv) -> int:
    try:
        from .export.cli import main as export_main
    except ImportError as e:
        print(f"gpudelegate export needs the export extra (torch): {e}", file=sys.stderr)
        return 2
    return export_main(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="gpudelegate", description="Run one lowered model on WebGPU, in the browser, and on CUDA.")
    sub = p.add_subparsers(dest="cmd", required=True)

    pi = sub.add_parser("inspect", help="methods, ops, constants and weights by type (float32, float16, q4_1, ...), "
                                        "memory plan, prepack, offload floor")
    pi.add_argument("file")
    pi.add_argument("--budget", type=_parse_budget, default=None, help="weight budget (e.g. 300MB) for the offload plan")
    pi.set_defaults(fn=cmd_inspect)

    pr = sub.add_parser("run", help="run a method on random (or given) inputs and time it")
    pr.add_argument("file")
    pr.add_argument("--device", default="auto", help="auto | reference | wgpu | dawn | cuda")
    pr.add_argument("--method", default=None)
    pr.add_argument("--inputs", default=None, help=".npz with one array per input, named as the method's inputs "
                                                   "(np.savez(f, ids=..., mask=...)); see inspect for the names")
    pr.add_argument("--budget", type=_parse_budget, default=None, help="weight budget: offload weights above it")
    pr.add_argument("--repeat", type=_positive_int, default=5, help="timed runs after one warm-up (>= 1)")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--profile", action="store_true", help="per-op GPU time from timestamp queries")
    pr.add_argument("--precision", choices=("exact", "fast"), default="exact",
                    help="fast: WebGPU products with float16 inputs and float32 accumulation (tensor cores where "
                         "the device has subgroup matrices); the reference and CUDA compute exactly either way")
    pr.set_defaults(fn=cmd_run)

    pd = sub.add_parser("devices", help="which devices start here (WebGPU backends with their features and "
                                        "subgroup-matrix configs)")
    pd.set_defaults(fn=cmd_devices)

    sub.add_parser("export", help="export a model to a program file (see gpudelegate export --help)", add_help=False)

    if argv and argv[0] == "export":
        return cmd_export(argv[1:])
    a = p.parse_args(argv)
    from .errors import GpuDelegateError

    try:
        return a.fn(a)
    except GpuDelegateError as e:
        print(f"gpudelegate: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
