"""The ``gpudelegate`` command line: inspect, run, export, devices."""

from __future__ import annotations

import argparse
import sys
import time


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

    prog = load(a.file)
    print(format_report(describe(prog, weight_budget=a.budget, file_size=_file_size(a.file))))
    return 0


def _file_size(path) -> int:
    import os

    return os.path.getsize(path)


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
    import numpy as np

    from .environment import Environment

    opts = {"profile": True} if a.profile else {}
    with Environment() as env:
        t0 = time.perf_counter()
        s = env.session(a.file, device=a.device, weight_budget=a.budget, **opts)
        t1 = time.perf_counter()
        method = a.method or s.methods[0]
        sig = s.signature(method)
        if a.inputs:
            data = np.load(a.inputs)
            xs = [data[k] for k in data.files]
        else:
            xs = _random_inputs(sig, a.seed)
        s.run(method, xs)  # warm-up (pipelines, first-use allocations)
        times = []
        for _ in range(a.repeat):
            r0 = time.perf_counter()
            outs = s.run(method, xs)
            times.append(time.perf_counter() - r0)
        print(f"device: {s.device}  build: {t1 - t0:.3f}s  ({', '.join(f'{k} {v:.3f}s' for k, v in s.timings.items())})")
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
                print(f"{kind:<10} available  {ctx.info()}")
            except DeviceError as e:
                print(f"{kind:<10} unavailable: {e}")
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

    pi = sub.add_parser("inspect", help="methods, ops, constants, memory plan, prepack, offload floor")
    pi.add_argument("file")
    pi.add_argument("--budget", type=_parse_budget, default=None, help="weight budget (e.g. 300MB) for the offload plan")
    pi.set_defaults(fn=cmd_inspect)

    pr = sub.add_parser("run", help="run a method on random (or given) inputs and time it")
    pr.add_argument("file")
    pr.add_argument("--device", default="auto", help="auto | reference | wgpu | cuda")
    pr.add_argument("--method", default=None)
    pr.add_argument("--inputs", default=None, help=".npz with the inputs in signature order")
    pr.add_argument("--budget", type=_parse_budget, default=None, help="weight budget: offload weights above it")
    pr.add_argument("--repeat", type=int, default=5)
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--profile", action="store_true", help="per-op GPU time from timestamp queries")
    pr.set_defaults(fn=cmd_run)

    pd = sub.add_parser("devices", help="which devices start here")
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
