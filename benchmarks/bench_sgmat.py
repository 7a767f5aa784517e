"""The subgroup-matrix (tensor-core) products of shaders/matmul_sgmat*.wgsl on Dawn against cuBLAS.

Runs the kernels straight through wgpudawn (Dawn instance toggles ``allow_unsafe_apis`` and
``vulkan_enable_f16_on_nvidia``, device feature ``chromium-experimental-subgroup-matrix``), so it
measures the WGSL alone. One call: a correctness check of every variant on odd shapes, every
operand layout and dtype, bias + gelu, against float64 numpy (bound: |C - C64| <= (2^-10 + K 2^-22)
(|A| @ |B|) + 1e-6, the rounding of both inputs to float16 plus float32 accumulation); then every
variant at 4096^3, 4096x384x1536 and 4096x1536x384 (M x N x K, B as a linear's weight [N, K]) with
float16 operands and with float32 operands (precision="fast": converted as staged, or by a
float16 prepass timed with the product), each checked on three 64-row bands of C against float64
before it is timed; torch's cuBLAS float32 (TF32 off) and float16 in the same process; one table.
Timing waits on a 16-byte marker buffer, never on C.

    python benchmarks/bench_sgmat.py [--out DIR] [--repeat N] [--minilm-too]
    python benchmarks/bench_sgmat.py --minilm [--out DIR] [--variants mm_sgmat_d8,...]
    python benchmarks/bench_sgmat.py --dry     # any Dawn adapter: the plan, and the WGSL compiled
                                               # with the matrix builtins stubbed

Variants (ops_sgmat.py, Tuning fields): the staged entries mm_sgmat (4 subgroups of 64x64, K step
32), mm_sgmat8 (8 of 32x64), mm_sgmat8k (K step 64, 44 KiB), mm_sgmat with double-buffered tiles
(Tuning.sgmat_stages=2, 48 KiB) and with float32 operands converted to float16 first
(Tuning.sgmat_prepass); the direct entries (matmul_sgmat_direct.wgsl: fragments loaded straight
from float16 storage, no workgroup memory in the K loop) mm_sgmat_d (4 of 64x64), mm_sgmat_d8
(8 of 32x64), mm_sgmat_dw (8 of 64x64, 128x256 tiles).

``--minilm`` instead runs MiniLM-L6 (seeded random weights) at 1x128 and 32x128 through
gpudelegate on Dawn with precision="exact" and "fast" (the default entry and each of
``--variants``) against PyTorch eager float32 and float16 on the same GPU (latency of a run:
inputs up, embeddings down; median of repeated runs), the cosine of each embedding against the
model in float64, the GPU time of the chain and of its linears (timestamp queries), and the GPU
time of one float32 linear per shape with each precision and variant. ``--minilm-too`` runs it
after the kernel table in a second process (Dawn's instance toggles are set once per process).

Needs a GPU adapter with the feature (an NVIDIA GPU through Dawn's Vulkan backend); exits 2 with
the reason where there is none.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TOGGLES = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"]
FEATURE = "chromium-experimental-subgroup-matrix"
STAGED_FILE, DIRECT_FILE = "matmul_sgmat.wgsl", "matmul_sgmat_direct.wgsl"
# workgroup memory (bytes) with one stage, and tiles (ops_sgmat.ENTRY_POINTS, ops_sgmat.TILES)
NEEDS = {"mm_sgmat": 28672, "mm_sgmat8": 28672, "mm_sgmat8k": 45056,
         "mm_sgmat_d": 26624, "mm_sgmat_d8": 26624, "mm_sgmat_dw": 26624}
DIRECT = ("mm_sgmat_d", "mm_sgmat_d8", "mm_sgmat_dw")
TILES = {"mm_sgmat_dw": (128, 256)}
# (label, entry, stages, prepass): prepass = float32 operands converted to float16 first (always
# for the direct entries, which read float16 storage)
VARIANTS = [("mm_sgmat", "mm_sgmat", 1, False), ("mm_sgmat stages2", "mm_sgmat", 2, False),
            ("mm_sgmat prepass", "mm_sgmat", 1, True), ("mm_sgmat8", "mm_sgmat8", 1, False),
            ("mm_sgmat8k", "mm_sgmat8k", 1, False), ("mm_sgmat_d", "mm_sgmat_d", 1, True),
            ("mm_sgmat_d8", "mm_sgmat_d8", 1, True), ("mm_sgmat_dw", "mm_sgmat_dw", 1, True)]
SHAPES = [(4096, 4096, 4096), (4096, 384, 1536), (4096, 1536, 384)]

# float32 -> float16, two halves per word (the lowering's prepass is elementwise.wgsl's copy into
# a float16 scratch; this is the same work: read 4 bytes, write 2, per element)
CVT_WGSL = """
@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read_write> Y: array<u32>;
@group(0) @binding(2) var<uniform> NP: vec4<u32>;
@compute @workgroup_size(256)
fn cvt(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>) {
    let i = g.x + g.y * ng.x * 256u;
    let n = NP.x;
    if (2u * i >= n) {
        return;
    }
    var hi = 0.0;
    if (2u * i + 1u < n) {
        hi = X[2u * i + 1u];
    }
    Y[i] = pack2x16float(vec2<f32>(X[2u * i], hi));
}
"""


MATRIX_BYTES = 1024  # one 16x16 float32 matrix


def tile_of(entry):
    return TILES.get(entry, (128, 128))


def need_bytes(entry, stages):
    return NEEDS[entry] if entry in DIRECT else NEEDS[entry] + (stages - 1) * (NEEDS[entry] - 8192)


def open_device():
    import wgpudawn as wgpu
    from wgpudawn.backends.dawn import extras

    extras.set_instance_extras(enable_toggles=TOGGLES)
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    if adapter is None or not {FEATURE, "shader-f16", "subgroups"} <= set(adapter.features):
        name = adapter.info.get("device", "?") if adapter is not None else "none"
        lacks = sorted({FEATURE, "shader-f16", "subgroups"} - set(adapter.features)) if adapter is not None else []
        return wgpu, adapter, f"no subgroup-matrix adapter ({name}{': lacks ' + ', '.join(lacks) if lacks else ''})"
    props = extras.get_adapter_properties(adapter)
    lim = adapter.limits
    want = {k: lim[k] for k in ("max-buffer-size", "max-storage-buffer-binding-size",
                                "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup")}
    dev = adapter.request_device_sync(required_features=[FEATURE, "shader-f16", "subgroups"], required_limits=want)
    info = {"adapter": adapter.info.get("device", "?"), "configs": [
        f"{c['component_type']}->{c['result_component_type']} {c['m']}x{c['n']}x{c['k']}"
        for c in props.get("subgroup_matrix_configs", ())],
        "workgroup_storage": lim["max-compute-workgroup-storage-size"]}
    return wgpu, dev, info


def params(M, N, K, a_sm, b_sk, b_sn, bias_base=0) -> bytes:
    # MMParams (shaders/mm_params.wgsl): one batch entry, C contiguous [M][N].
    return struct.pack("<22IfI", M, N, K, 1, 0, 0, 0, bias_base, a_sm, 1, b_sk, b_sn, N, 1, 1, 1,
                       0, 0, 0, 0, 0, 0, 1.0, 0) + bytes(8)


class Kernel:
    def __init__(self, wgpu, dev):
        from gpudelegate import shaders

        self.wgpu, self.dev = wgpu, dev
        self.source = shaders.source
        self.modules = {}  # made on first use: a shader that fails to compile costs its variants only
        self.broken = {}  # variant label -> the error that stopped it (compile or run)
        self.cvt_pipe = dev.create_compute_pipeline(
            layout="auto", compute={"module": dev.create_shader_module(code=CVT_WGSL), "entry_point": "cvt"})
        self.pipes = {}
        self.storage = 0

    def pipeline(self, entry, consts):
        key = (entry,) + tuple(sorted(consts.items()))
        if key not in self.pipes:
            f = DIRECT_FILE if entry in DIRECT else STAGED_FILE
            if f not in self.modules:
                self.modules[f] = self.dev.create_shader_module(code=self.source(f))
            module = self.modules[f]
            self.pipes[key] = self.dev.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": entry, "constants": consts})
        return self.pipes[key]

    def buf(self, data: bytes = b"", size: int = 0, extra_usage=0):
        U = self.wgpu.BufferUsage
        # at least one 16x16 float32 matrix: Dawn refuses a binding that subgroupMatrixLoad/Store
        # touch when it is smaller than one matrix, whatever the dispatch reaches (the lowering
        # sends such products to the staged kernel: ops_sgmat.DIRECT_MIN_BYTES)
        n = max(MATRIX_BYTES, (max(len(data), size) + 15) // 16 * 16)
        b = self.dev.create_buffer(size=n, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST | extra_usage)
        if data:
            self.dev.queue.write_buffer(b, 0, bytes(data) + bytes(n - len(data)))
        return b

    def group(self, pipe, bufs):
        entries = [{"binding": k, "resource": {"buffer": bb, "offset": 0, "size": bb.size if s is None else s}}
                   for k, (bb, s) in bufs.items()]
        return self.dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)

    def cvt_step(self, src, n):
        """A dispatch converting n float32 values of ``src`` into a new float16 buffer."""
        U = self.wgpu.BufferUsage
        dst = self.buf(size=2 * n)
        uni = self.dev.create_buffer(size=16, usage=U.UNIFORM | U.COPY_DST)
        self.dev.queue.write_buffer(uni, 0, struct.pack("<4I", n, 0, 0, 0))
        words = -(-n // 2)
        gx = min(-(-words // 256), 65535)
        grid = (gx, -(-words // (gx * 256)), 1)
        return (self.cvt_pipe, self.group(self.cvt_pipe, {0: (src, None), 1: (dst, None), 2: (uni, 16)}), grid), dst

    def setup(self, a, b, kmajor, entry="mm_sgmat", stages=1, prepass=False, bias=None, act=0, ops=None):
        """The dispatches of C = a @ (b.T if kmajor else b) (+ bias, gelu): a float16 prepass per
        float32 operand where ``prepass`` (or a direct entry), then the product. ``ops``: the
        operand buffers already uploaded (a, b), else uploaded here."""
        M, K = a.shape
        N = b.shape[0] if kmajor else b.shape[1]
        U = self.wgpu.BufferUsage
        abuf, bbuf = ops if ops is not None else (self.buf(a.tobytes()), self.buf(b.tobytes()))
        steps = []
        da, db = int(a.dtype == np.float16), int(b.dtype == np.float16)
        if prepass or entry in DIRECT:
            if not da:
                st, abuf = self.cvt_step(abuf, a.size)
                steps.append(st)
            if not db:
                st, bbuf = self.cvt_step(bbuf, b.size)
                steps.append(st)
            da = db = 1
        consts = {"B_KMAJOR": bool(kmajor), "BIAS": 1 if bias is not None else 0, "ACT": act}
        if entry not in DIRECT:
            consts.update(DTA=da, DTB=db, STAGES=stages)
        pipe = self.pipeline(entry, consts)
        uni = self.dev.create_buffer(size=112, usage=U.UNIFORM | U.COPY_DST)
        self.dev.queue.write_buffer(uni, 0, params(M, N, K, K, 1 if kmajor else N, K if kmajor else 1))
        c = self.dev.create_buffer(size=max(MATRIX_BYTES, M * N * 4), usage=U.STORAGE | U.COPY_SRC)
        bufs = {0: (uni, 112), 1: (c, max(MATRIX_BYTES, M * N * 4)), 2: (abuf, None), 3: (bbuf, None),
                4: (self.buf(bias.astype(np.float32).tobytes()) if bias is not None else self.buf(bytes(16)), None)}
        for k in (5, 6, 7):
            bufs[k] = (self.buf(bytes(16)), None)
        bm, bn = tile_of(entry)
        steps.append((pipe, self.group(pipe, bufs), (-(-N // bn), -(-M // bm), 1)))
        return steps, c, (M, N)

    def run(self, setup, times=1):
        steps = setup[0]
        enc = self.dev.create_command_encoder()
        p = enc.begin_compute_pass()
        for _ in range(times):
            for pipe, group, grid in steps:
                p.set_pipeline(pipe)
                p.set_bind_group(0, group)
                p.dispatch_workgroups(*grid)
        p.end()
        self.dev.queue.submit([enc.finish()])

    def read(self, setup, rows=None):
        """C, or its rows [r0, r1) for each (r0, r1) in ``rows`` (stacked)."""
        _, c, (M, N) = setup
        if rows is None:
            return np.frombuffer(self.dev.queue.read_buffer(c), np.float32)[:M * N].reshape(M, N)
        return np.concatenate([np.frombuffer(self.dev.queue.read_buffer(c, r0 * N * 4, (r1 - r0) * N * 4),
                                             np.float32).reshape(r1 - r0, N) for r0, r1 in rows])

    def wait(self):
        """Wait for the queue by reading back 16 bytes (reading C itself would time its copy)."""
        if not hasattr(self, "_marker"):
            self._marker = self.buf(bytes(16))
        self.dev.queue.read_buffer(self._marker)

    def time_ms(self, setup, repeat):
        self.run(setup, 2)
        self.wait()
        t0 = time.perf_counter()
        self.run(setup, repeat)
        self.wait()
        return (time.perf_counter() - t0) * 1e3 / repeat


def gelu(x):
    from math import erf
    return 0.5 * x * (1.0 + np.vectorize(erf)(x / np.sqrt(2.0)))


def reference(a, b, kmaj, bias=None, rows=None):
    """(C64, bound) of a @ (b.T if kmaj else b) (+ bias, gelu) in float64, for the rows in the
    bands ``rows`` (all by default)."""
    a64 = a.astype(np.float64)
    if rows is not None:
        a64 = np.concatenate([a64[r0:r1] for r0, r1 in rows])
    b64 = b.astype(np.float64).T if kmaj else b.astype(np.float64)
    ref = a64 @ b64
    mag = np.abs(a64) @ np.abs(b64)
    if bias is not None:
        ref = gelu(ref + bias)  # gelu is 1-Lipschitz-ish (|gelu'| <= 1.13): the bound scales by it
        mag = 1.13 * mag
    return ref, (2.0 ** -10 + a.shape[1] * 2.0 ** -22) * mag + 1e-6


def bound_check(got, a, b, kmaj, bias=None, rows=None, ref=None):
    """(ok, max error, worst error/bound) of ``got`` against float64 (rows: bands of C; ref: a
    precomputed ``reference``)."""
    ref, bound = ref if ref is not None else reference(a, b, kmaj, bias, rows)
    err = np.abs(got.astype(np.float64) - ref)
    return bool(np.all(err <= bound)), float(err.max()) if err.size else 0.0, \
        float((err / bound).max()) if err.size else 0.0


def variants(storage):
    return [v for v in VARIANTS if need_bytes(v[1], v[2]) <= storage]


def check(k: Kernel) -> list:
    rng = np.random.default_rng(0)
    rows = []
    cases = [  # (M, N, K, dtype A, dtype B, kmajor, bias/act)
        (257, 131, 200, np.float16, np.float16, True, False),
        (257, 131, 200, np.float32, np.float16, True, False),
        (300, 260, 68, np.float16, np.float16, False, False),
        (129, 388, 36, np.float32, np.float32, False, False),
        (64, 384, 384, np.float32, np.float16, True, True),
        (1, 7, 4, np.float32, np.float32, True, False),
        # whole tiles, aligned rows: the direct entries' storage loads (K 80: a staged 16 tail)
        (256, 512, 80, np.float16, np.float16, True, False),
        (256, 512, 96, np.float32, np.float32, False, False),
        (259, 264, 64, np.float16, np.float16, True, True),
    ]
    for label, entry, st, pre in variants(k.storage):
        for M, N, K, da, db, kmaj, epi in cases:
            a = rng.standard_normal((M, K)).astype(da)
            b = rng.standard_normal((N, K) if kmaj else (K, N)).astype(db)
            bias = rng.standard_normal(N).astype(np.float32) if epi else None
            if label in k.broken:
                continue
            try:
                s = k.setup(a, b, kmaj, entry, st, pre, bias, 1 if epi else 0)
                k.run(s)
                got = k.read(s)
            except Exception as e:  # a compile error: report it, go on with the other variants
                k.broken[label] = f"{type(e).__name__}: {e}"
                print(f"{label}: {k.broken[label][:3000]}", file=sys.stderr, flush=True)
                rows.append({"case": f"{label} (does not run: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__})",
                             "ok": False, "max_err": float("nan"), "worst_ratio": float("nan")})
                continue
            ok, mx, worst = bound_check(got, a, b, kmaj, bias)
            rows.append({"case": f"{label} {M}x{N}x{K} A {np.dtype(da).name} B {np.dtype(db).name} "
                                 f"{'k-major' if kmaj else 'n-major'}{' bias+gelu' if epi else ''}",
                         "ok": ok, "max_err": mx, "worst_ratio": worst})
            if not ok:
                print(json.dumps(rows[-1]), flush=True)
    return rows


def dry(wgpu, adapter) -> int:
    """Print the plan and compile every entry point's WGSL on this adapter with the matrix types
    and builtins replaced by stand-ins (Tint checks the rest as written: syntax, types, the
    uniformity of every barrier, workgroup memory)."""
    from gpudelegate import shaders

    print("variants:", ", ".join(v[0] for v in VARIANTS))
    print("shapes (M x N x K):", ", ".join("x".join(map(str, s)) for s in SHAPES), "; operands float16, float32")
    if adapter is None:
        print("bench_sgmat --dry: no adapter at all", file=sys.stderr)
        return 2
    feats = [f for f in ("shader-f16", "subgroups") if f in adapter.features]
    lim = adapter.limits
    dev = adapter.request_device_sync(required_features=feats, required_limits={
        k: lim[k] for k in ("max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup")})
    print(f"adapter {adapter.info.get('device', '?')}: features {feats}, "
          f"workgroup storage {lim['max-compute-workgroup-storage-size']}")
    if len(feats) < 2:
        print("bench_sgmat --dry: needs shader-f16 and subgroups for the stubbed compile", file=sys.stderr)
        return 2
    dev.create_compute_pipeline(layout="auto", compute={"module": dev.create_shader_module(code=CVT_WGSL),
                                                        "entry_point": "cvt"})
    rc = 0
    for label, entry, st, pre in VARIANTS:
        for consts in ({}, {"B_KMAJOR": False, "DT_OUT": 1, "BIAS": 1, "ACT": 1, "RES": True, "NC": 3}):
            c = dict(consts)
            if entry not in DIRECT:
                c.update(STAGES=st, DTA=int(pre))
            need = need_bytes(entry, st)
            try:
                module = dev.create_shader_module(code=stub(shaders.source(DIRECT_FILE if entry in DIRECT else STAGED_FILE)))
                dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": entry, "constants": c})
                print(f"compiles (stubbed): {label} {c}")
            except Exception as e:
                if need > lim["max-compute-workgroup-storage-size"]:
                    print(f"skipped: {label} needs {need} bytes of workgroup memory")
                    continue
                rc = 1
                print(f"FAILS: {label} {c}: {str(e)[:3000]}")
    return rc


def stub(src: str) -> str:
    """``src`` with every subgroup-matrix type and builtin replaced by a plain stand-in."""
    src = src.replace("enable chromium_experimental_subgroup_matrix;", "")
    src = src.replace("diagnostic(off, chromium.subgroup_matrix_uniformity);", "")
    src = src.replace("subgroup_matrix_result<f32, 16, 16>()", "SMR()")
    src = re.sub(r"subgroupMatrixLoad<subgroup_matrix_(left|right)<f16, 16, 16>, (row|col)_major>\(&(\w+), ",
                 lambda m: f"ld_{m.group(1)}_{m.group(3)}(", src)
    src = re.sub(r"subgroupMatrixStore<row_major>\(&(\w+), ", lambda m: f"st_{m.group(1)}(", src)
    src = src.replace("subgroupMatrixMultiplyAccumulate(", "mma(")
    src = src.replace("subgroup_matrix_left<f16, 16, 16>", "SML").replace("subgroup_matrix_right<f16, 16, 16>", "SMRt")
    left = re.findall(r".*subgroup_?[mM]atrix.*", src)
    assert not left, left[:3]
    pre = ["struct SMR { v: vec4<f32> }", "struct SML { v: vec4<f16> }", "struct SMRt { v: vec4<f16> }",
           "fn mma(a: SML, b: SMRt, c: SMR) -> SMR { return SMR(c.v + vec4<f32>(a.v * b.v)); }"]
    for arr in sorted(set(re.findall(r"ld_(?:left|right)_(\w+)\(", src))):
        for kind, ty in (("left", "SML"), ("right", "SMRt")):
            pre.append(f"fn ld_{kind}_{arr}(o: u32, s: u32) -> {ty} {{ return {ty}(vec4<f16>({arr}[o + s])); }}")
    for arr in sorted(set(re.findall(r"st_(\w+)\(", src))):
        pre.append(f"fn st_{arr}(o: u32, m: SMR, s: u32) {{ {arr}[o + s] = m.v.x; }}")
    return src + "\n" + "\n".join(pre) + "\n"


def cublas_ms(M, N, K, dtype, repeat):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(repeat):
        a @ b
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / repeat


def _median_ms(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def _modes(variants) -> list:
    """(name, precision, tuning) of each gpudelegate run: exact, fast (default entry), fast with
    each of ``variants`` forced (Tuning.sgmat_entry)."""
    from gpudelegate.webgpu.lowering import Tuning

    return [("exact", "exact", None), ("fast", "fast", None)] + \
        [(f"fast {v}", "fast", Tuning(sgmat_entry=v)) for v in variants]


def _session(env, prog, precision, tuning, **kw):
    opts = {"tuning": tuning} if tuning is not None else {}
    return env.session(prog, device="dawn", precision=precision, **opts, **kw)


def _op_gpu_ms(env, prog, inputs, precision, tuning=None, runs=3) -> dict:
    """GPU time by op (ms, the fastest of ``runs``) from timestamp queries: a session with
    profile=True times each node in a compute pass of its own (WebGPUExecutor.last_profile)."""
    best: dict = {}
    with _session(env, prog, precision, tuning, profile=True) as s:
        for _ in range(runs + 1):
            s.run("forward", inputs)
            by_op: dict = {}
            for op, _node, sec in s.executor.last_profile:
                by_op[op] = by_op.get(op, 0.0) + sec * 1e3
            best = {op: min(v, best.get(op, v)) for op, v in by_op.items()}
    best["total"] = sum(v for k, v in best.items() if k != "total")
    return best


def linears(env, rows: list, modes) -> None:
    """One float32 linear (weights [N, K], no bias) per shape: GPU time of its kernels (the
    float16 prepass included where a mode has one) with each mode: "exact" (the float kernels),
    "fast" (the default subgroup-matrix entry) and each forced variant."""
    import torch

    from gpudelegate.export.writer import export_program

    for M, N, K in ((4096, 4096, 4096), (4096, 384, 1536), (4096, 1536, 384), (4096, 384, 384)):
        torch.manual_seed(0)
        with torch.no_grad():
            prog = export_program(torch.nn.Linear(K, N, bias=False).eval(), (torch.zeros(M, K),), progress=False)
        x = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
        row = {"shape": f"linear {M}x{N}x{K}"}
        for name, precision, tuning in modes:
            ms = _op_gpu_ms(env, prog, [x], precision, tuning)["linear"]
            row[name + "_ms"] = ms
            row[name + "_tflops"] = 2.0 * M * N * K / ms / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)


def minilm(out, repeat, variants=()) -> int:
    import torch

    from gpudelegate.environment import Environment
    from gpudelegate.export.models import minilm as mm
    from gpudelegate.export.writer import export_program

    t0 = time.perf_counter()
    modes = _modes(variants)
    names = [m[0] for m in modes]
    torch.manual_seed(0)
    model = mm.MiniLM(mm.MiniLMConfig()).eval()
    rows = []
    env = Environment(device_options={"dawn": {"toggles": TOGGLES}})
    for b, t in ((1, 128), (32, 128)):
        model.float().cpu()  # the eager runs below move and cast it in place
        with torch.no_grad():
            prog = export_program(model, mm.example_inputs(b, t), progress=False)
        rng = np.random.default_rng(b * 1000 + t)
        ids = rng.integers(1000, model.cfg.vocab_size, (b, t)).astype(np.int32)
        mask = np.ones((b, t), np.int32)
        mask[b // 2:, t - t // 4:] = 0
        tid, tmask = torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda()
        with torch.no_grad():
            ref = model.double().cuda()(tid, tmask).cpu().numpy()
        row = {"shape": f"{b}x{t}"}

        def cos(x):
            x = np.asarray(x, np.float64)
            return float(np.min(np.sum(x * ref, -1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(ref, axis=-1)))

        for dtype, name in ((torch.float32, "eager_fp32"), (torch.float16, "eager_fp16")):
            dev_model = model.to(dtype).cuda()

            def once():
                with torch.no_grad():
                    y = dev_model(tid, tmask).float().cpu()
                return y

            for _ in range(3):
                once()
            row[name + "_ms"] = _median_ms(once, repeat)
            row[name + "_cos"] = cos(once().numpy())
        for name, precision, tuning in modes:
            with _session(env, prog, precision, tuning) as s:
                got = s.run("forward", [ids, mask])[0]
                for _ in range(3):
                    s.run("forward", [ids, mask])
                row[name + "_ms"] = _median_ms(lambda: s.run("forward", [ids, mask]), repeat)
                row[name + "_cos"] = cos(got)
                row[name + "_sgmat_launches"] = sum(
                    "mm_sgmat" in L.pipeline.label for n in s.executor.recorded[0].nodes for L in n.launches)
            prof = _op_gpu_ms(env, prog, [ids, mask], precision, tuning)  # where the GPU time goes
            row[name + "_gpu_ms"] = prof["total"]
            row[name + "_linear_gpu_ms"] = prof.get("linear", 0.0)
        rows.append(row)
        print(json.dumps(row), flush=True)
    kernels: list = []
    linears(env, kernels, modes)
    env.close()
    lines = ["| shape | eager fp32 ms | eager fp16 ms | cos fp16 eager | " + " | ".join(
        f"dawn {n} ms | {n} / fp32 eager | {n} / fp16 eager | cos {n} | sgmat launches" for n in names) + " |",
        "|" + "---|" * (3 + 5 * len(names) + 1)]
    lines += [f"| {r['shape']} | {r['eager_fp32_ms']:.3f} | {r['eager_fp16_ms']:.3f} | {r['eager_fp16_cos']:.6f} | " +
              " | ".join(f"{r[n + '_ms']:.3f} | {r['eager_fp32_ms'] / r[n + '_ms']:.2f}x | "
                         f"{r['eager_fp16_ms'] / r[n + '_ms']:.2f}x | {r[n + '_cos']:.6f} | {r[n + '_sgmat_launches']}"
                         for n in names) + " |" for r in rows]
    lines += ["", "GPU time by timestamp queries (a pass per node): whole chain and its linears, ms", "",
              "| shape | " + " | ".join(f"{n} chain | {n} linears" for n in names) + " |",
              "|" + "---|" * (1 + 2 * len(names))]
    lines += [f"| {r['shape']} | " + " | ".join(f"{r[n + '_gpu_ms']:.3f} | {r[n + '_linear_gpu_ms']:.3f}" for n in names)
              + " |" for r in rows]
    lines += ["", "| one float32 linear | " + " | ".join(f"{n} ms | {n} TFLOP/s" for n in names) + " |",
              "|" + "---|" * (1 + 2 * len(names))]
    lines += [f"| {r['shape']} | " + " | ".join(f"{r[n + '_ms']:.3f} | {r[n + '_tflops']:.1f}" for n in names) + " |"
              for r in kernels]
    lines += ["", f"minilm: {time.perf_counter() - t0:.1f} s"]
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "minilm.json").write_text(json.dumps({"minilm": rows, "linears": kernels}, indent=1))
        (Path(out) / "minilm.md").write_text(text + "\n")
    return 0


def bench(k: Kernel, info, repeat: int) -> tuple:
    """Every variant at SHAPES with float16 and float32 operands: checked on three 64-row bands
    of C, then timed; cuBLAS float32 and float16 per shape in the same process."""
    rows, base = [], {}
    for M, N, K in SHAPES:
        flop = 2.0 * M * N * K
        sh = f"{M}x{N}x{K}"
        try:
            import torch
            base[sh] = {"cublas_fp32": cublas_ms(M, N, K, torch.float32, repeat),
                        "cublas_fp16": cublas_ms(M, N, K, torch.float16, repeat)}
        except Exception as e:  # no torch or no CUDA: the kernels' numbers alone
            print(f"cuBLAS baseline skipped: {e}", file=sys.stderr)
            base[sh] = {}
        rng = np.random.default_rng(M + N + K)
        # float16 values (exact in float32 too): one float64 reference serves both operand dtypes
        a16 = rng.standard_normal((M, K)).astype(np.float16)
        b16 = rng.standard_normal((N, K)).astype(np.float16)
        bands = [(0, 64), (M // 2 - 32, M // 2 + 32), (M - 64, M)]
        ref = reference(a16, b16, True, rows=bands)
        for dt in (np.float16, np.float32):
            a, b = a16.astype(dt), b16.astype(dt)
            ops = (k.buf(a.tobytes()), k.buf(b.tobytes()))
            for label, entry, st, pre in variants(k.storage):
                if pre and dt == np.float16 and entry not in DIRECT:
                    continue  # the prepass changes nothing for float16 operands
                if label in k.broken:
                    continue
                try:
                    s = k.setup(a, b, True, entry, st, pre, ops=ops)
                    k.run(s)
                    ok, mx, worst = bound_check(k.read(s, bands), a, b, True, rows=bands, ref=ref)
                    ms = k.time_ms(s, repeat)  # timed even when wrong (the table says FAIL)
                except Exception as e:
                    k.broken[label] = f"{type(e).__name__}: {e}"
                    print(f"{label}: {k.broken[label][:3000]}", file=sys.stderr, flush=True)
                    continue
                row = {"shape": sh, "operands": np.dtype(dt).name, "variant": label, "ok": ok,
                       "worst_ratio": worst, "ms": ms, "tflops": flop / ms / 1e9}
                for name, bms in base[sh].items():
                    row[f"{name}_tflops"] = flop / bms / 1e9
                    row[f"x_{name}"] = bms / ms
                rows.append(row)
                print(json.dumps(row), flush=True)
            del ops
    return rows, base


def table(info, checks, rows) -> str:
    nan = float("nan")
    bad = [c for c in checks if not c["ok"]]
    lines = [f"# subgroup-matrix matmul on {info['adapter']}", "", f"configs: {', '.join(info['configs'])}; "
             f"workgroup storage {info['workgroup_storage']}", "",
             f"checks (odd shapes, every layout, bias + gelu): {len(checks) - len(bad)} of {len(checks)} within the "
             f"float16-input bound; worst error/bound {max([c['worst_ratio'] for c in checks if c['worst_ratio'] == c['worst_ratio']] or [nan]):.3f}"]
    if bad:
        lines += ["", "| failed check | max err | err / bound |", "|---|---|---|"]
        lines += [f"| {c['case']} | {c['max_err']:.3g} | {c['worst_ratio']:.3f} |" for c in bad]
    lines += ["", "| variant | shape (MxNxK) | operands | TFLOP/s | vs cuBLAS fp32 | vs cuBLAS fp16 | cuBLAS fp32 | "
              "cuBLAS fp16 | ms | check (err/bound) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (VARIANTS.index(next(v for v in VARIANTS if v[0] == r["variant"])),
                                         [f"{m}x{n}x{kk}" for m, n, kk in SHAPES].index(r["shape"]), r["operands"])):
        lines.append(f"| {r['variant']} | {r['shape']} | {r['operands']} | {r['tflops']:.1f} | "
                     f"{r.get('x_cublas_fp32', nan):.2f}x | {r.get('x_cublas_fp16', nan):.2f}x | "
                     f"{r.get('cublas_fp32_tflops', nan):.1f} | {r.get('cublas_fp16_tflops', nan):.1f} | "
                     f"{r['ms']:.3f} | {'ok' if r['ok'] else 'FAIL'} {r['worst_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for sgmat.json/.md (and minilm.json/.md)")
    ap.add_argument("--repeat", type=int, default=20, help="timed dispatches per variant and shape")
    ap.add_argument("--minilm", action="store_true", help="MiniLM-L6 through gpudelegate (exact, fast) vs eager")
    ap.add_argument("--minilm-too", action="store_true", help="after the kernel table, --minilm in a second process")
    ap.add_argument("--variants", default="mm_sgmat_d8",
                    help="--minilm: entries (Tuning.sgmat_entry) run with precision=fast besides the default, comma-separated")
    ap.add_argument("--dry", action="store_true", help="plan and stubbed compile on any Dawn adapter (no subgroup matrices needed)")
    a = ap.parse_args(argv)
    if a.minilm:
        return minilm(a.out, a.repeat, [v for v in a.variants.split(",") if v])
    t0 = time.perf_counter()
    wgpu, dev, info = open_device()
    if a.dry:
        return dry(wgpu, dev if isinstance(info, str) else None) if isinstance(info, str) else _dry_full(wgpu)
    if isinstance(info, str):
        print(f"bench_sgmat: {info}", file=sys.stderr)
        return 2
    k = Kernel(wgpu, dev)
    k.storage = info["workgroup_storage"]
    checks = check(k)
    print(f"checks: {sum(c['ok'] for c in checks)} of {len(checks)} ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    rows, base = bench(k, info, a.repeat)
    text = table(info, checks, rows)
    if k.broken:
        text += "\n\nvariants that did not run:\n" + "\n".join(f"- {v}: {e.splitlines()[0][:300] if e else ''}"
                                                             for v, e in k.broken.items())
    print(text, flush=True)
    print(f"kernel table: {time.perf_counter() - t0:.1f} s", flush=True)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sgmat.json").write_text(json.dumps({"device": info, "checks": checks, "rows": rows, "cublas_ms": base},
                                                   indent=1))
        (out / "sgmat.md").write_text(text + "\n")
    rc = 0 if all(c["ok"] for c in checks) and all(r["ok"] for r in rows) and not k.broken else 1
    if a.minilm_too:
        cmd = [sys.executable, __file__, "--minilm", "--repeat", str(min(a.repeat, 10)), "--variants", a.variants]
        if a.out:
            cmd += ["--out", a.out]
        left = max(15.0, 145.0 - (time.perf_counter() - t0))  # the whole call within ~150 s
        try:
            r = subprocess.run(cmd, timeout=left)
            rc = rc or r.returncode
        except subprocess.TimeoutExpired:
            print(f"--minilm stopped after {left:.0f} s (the call's budget); run it alone: "
                  f"{' '.join(cmd[1:])}", flush=True)
            rc = rc or 3
        print(f"total: {time.perf_counter() - t0:.1f} s", flush=True)
    return rc


def _dry_full(wgpu) -> int:
    # an adapter with subgroup matrices: the stubbed compile still runs on it (a fresh request)
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    return dry(wgpu, adapter)


if __name__ == "__main__":
    sys.exit(main())
