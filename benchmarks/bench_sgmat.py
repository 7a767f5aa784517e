"""The subgroup-matrix (tensor-core) products of shaders/matmul_sgmat.wgsl on Dawn against cuBLAS.

Runs the kernels straight through wgpudawn (Dawn instance toggles ``allow_unsafe_apis`` and
``vulkan_enable_f16_on_nvidia``, device feature ``chromium-experimental-subgroup-matrix``), so it
measures the WGSL alone. One call: a correctness check of every variant on odd shapes, every
operand layout and dtype, bias + gelu, against float64 numpy (bound: |C - C64| <= (2^-10 + K 2^-22)
(|A| @ |B|) + 1e-6, the rounding of both inputs to float16 plus float32 accumulation); then every
variant at 4096^3, 4096x384x1536 and 4096x1536x384 (M x N x K, B as a linear's weight [N, K]) with
float16 operands and with float32 operands (precision="fast": converted to float16 as staged),
each checked on three 64-row bands of C against float64 before it is timed; torch's cuBLAS
float32 (TF32 off) and float16 in the same process; one table. Timing waits on a 16-byte marker
buffer, never on C.

    python benchmarks/bench_sgmat.py [--out DIR] [--repeat N] [--only LABELS] [--tile SPEC ...]
                                     [--sizes MxNxK,...] [--device-toggles T,...] [--minilm-too]
    python benchmarks/bench_sgmat.py --minilm [--out DIR] [--variants mm_sgmat8,...]
    python benchmarks/bench_sgmat.py --minilm-profile 32x128 [--out DIR] [--repeat N]
    python benchmarks/bench_sgmat.py --attention 32x128,1x128 [--out DIR] [--repeat N] [--rounds R]
    python benchmarks/bench_sgmat.py --emulate   # any Dawn adapter with shader-f16: the checks, with
                                                 # the matrix builtins emulated per invocation
    python benchmarks/bench_sgmat.py --dry       # any Dawn adapter: the plan, every variant compiled
                                                 # with the matrix builtins emulated

Variants: every entry point of shaders/matmul_sgmat.py's SHAPES (the tiles ops_sgmat.py may
choose) with one shared stage and, where it fits the adapter's workgroup memory, two
(Tuning.sgmat_stages=2). ``--tile NAME:SGM,SGN,FM,FN,BK[,pad=P][,regs=R][,unit=U][,swz=G][,direct=1]`` adds an
entry point of another shape, generated for this run only (SGM x SGN subgroups of (16 FM) x (16 FN),
K step BK, staged rows padded by P halves, staging registers R: matmul_sgmat.py's REGS, U elements
per staged load, workgroups ordered in groups of G tile rows); ``--only``
keeps the variants whose labels it lists; ``--device-toggles`` gives Dawn device toggles (e.g.
``disable_robustness``: Dawn's bounds clamping of every array index and matrix load, which
costs these kernels most of their speed with float16 operands).

``--minilm-profile BxT`` runs MiniLM-L6 (seeded weights) at B x T with precision="fast" on Dawn
dispatch by dispatch: the profile (a pass per node), each dispatch alone (``--repeat`` times back
to back in one pass), each subgroup-matrix product alone with its epilogue constants off, and the
whole chain between two timestamps (its GPU time without the profile's passes); --out keeps the
rows as minilm_profile_BxT.json.

``--attention BxT,...`` runs MiniLM-L6 (seeded weights) at each B x T with precision="fast" on
Dawn with the prefill attention on subgroup matrices (the default) and on attn_tile
(Tuning(attn_sgmat=False)) in one process, alternated round by round with PyTorch eager float32
and float16: each session's attention dispatches alone (``--repeat`` back to back in one pass),
its whole chain between two timestamps, a run's latency (median), and the cosine of each
embedding to the model in float64; --out keeps minilm_attention.json / .md. Dawn's device
toggles come from GPUDELEGATE_DAWN_DEVICE_TOGGLES (one process per setting).

``--minilm`` instead runs MiniLM-L6 (seeded random weights) at 1x128 and 32x128 through
gpudelegate on Dawn with precision="exact" and "fast" (the default entry and each of
``--variants``) against PyTorch eager float32 and float16 on the same GPU (latency of a run:
inputs up, embeddings down; median of repeated runs), the cosine of each embedding against the
model in float64, the GPU time of the chain and of its linears (timestamp queries), and the GPU
time of one float32 linear per shape with each precision and variant. ``--minilm-too`` runs it
after the kernel table in a second process (Dawn's instance toggles are set once per process).

Needs a GPU adapter with the feature (an NVIDIA GPU through Dawn's Vulkan backend) except under
``--emulate`` and ``--dry``; exits 2 with the reason where there is none.
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

from gpudelegate.shaders import matmul_sgmat as gen

TOGGLES = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"]
FEATURE = "chromium-experimental-subgroup-matrix"
SOURCE_FILE = "matmul_sgmat.wgsl"
SHAPES = [(4096, 4096, 4096), (4096, 384, 1536), (4096, 1536, 384)]

MATRIX_BYTES = 1024  # one 16x16 float32 matrix


class Variant:
    """One timed configuration: an entry point (``shape``) and its shared stages."""

    def __init__(self, shape: gen.Shape, stages: int = 1):
        self.shape, self.stages = shape, stages
        self.label = shape.name + (f" stages{stages}" if stages > 1 else "")

    @property
    def need(self) -> int:
        return self.shape.workgroup_bytes(self.stages)


def parse_tile(spec: str) -> gen.Shape:
    """``NAME:SGM,SGN,FM,FN,BK[,pad=P][,regs=R][,unit=U][,swz=G][,direct=1]`` -> a Shape (checked)."""
    name, _, rest = spec.partition(":")
    parts = rest.split(",")
    nums = [p for p in parts if "=" not in p]
    opts = dict(p.split("=", 1) for p in parts if "=" in p)
    if not re.fullmatch(r"[A-Za-z_]\w*", name) or len(nums) != 5 or not all(p.isdigit() for p in nums) or \
            set(opts) - {"pad", "regs", "unit", "swz", "direct"} or \
            not all(opts.get(o, "0").isdigit() for o in ("pad", "unit", "swz", "direct")):
        raise argparse.ArgumentTypeError(f"--tile {spec!r}: NAME:SGM,SGN,FM,FN,BK[,pad=P][,regs=R][,unit=U][,swz=G][,direct=1]")
    for o in ("pad", "unit", "swz", "direct"):
        if o in opts:
            opts[o] = int(opts[o]) if o != "direct" else bool(int(opts[o]))
    s = gen.Shape(name, *map(int, nums), **opts)
    try:
        s.check()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def all_variants(shapes, storage: int, stages=(1, 2)) -> list:
    """Each shape with each of ``stages`` shared stages where it fits ``storage``."""
    return [Variant(s, st) for s in shapes for st in stages if s.workgroup_bytes(st) <= storage]


def open_device(device_toggles=(), emulate=False):
    import wgpudawn as wgpu
    from wgpudawn.backends.dawn import extras

    extras.set_instance_extras(enable_toggles=TOGGLES)
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    wanted = {"shader-f16"} if emulate else {FEATURE, "shader-f16", "subgroups"}
    if adapter is None or not wanted <= set(adapter.features):
        name = adapter.info.get("device", "?") if adapter is not None else "none"
        lacks = sorted(wanted - set(adapter.features)) if adapter is not None else []
        return wgpu, adapter, f"no {'shader-f16' if emulate else 'subgroup-matrix'} adapter " \
                              f"({name}{': lacks ' + ', '.join(lacks) if lacks else ''})"
    props = extras.get_adapter_properties(adapter)
    lim = adapter.limits
    want = {k: lim[k] for k in ("max-buffer-size", "max-storage-buffer-binding-size",
                                "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup")}
    dev = extras.request_device_sync(adapter, required_features=sorted(wanted), required_limits=want,
                                     enable_toggles=list(device_toggles))
    info = {"adapter": adapter.info.get("device", "?"), "configs": [
        f"{c['component_type']}->{c['result_component_type']} {c['m']}x{c['n']}x{c['k']}"
        for c in props.get("subgroup_matrix_configs", ())],
        "workgroup_storage": lim["max-compute-workgroup-storage-size"], "device_toggles": list(device_toggles),
        "emulated": emulate}
    return wgpu, dev, info


def params(M, N, K, a_sm, b_sk, b_sn, bias_base=0) -> bytes:
    # MMParams (shaders/mm_params.wgsl): one batch entry, C contiguous [M][N].
    return struct.pack("<22IfI", M, N, K, 1, 0, 0, 0, bias_base, a_sm, 1, b_sk, b_sn, N, 1, 1, 1,
                       0, 0, 0, 0, 0, 0, 1.0, 0) + bytes(8)


def wgsl(shapes, emulated=False) -> str:
    """matmul_sgmat.wgsl with the entry points of ``shapes`` (emulated: see :func:`emulate`)."""
    from gpudelegate import shaders

    text = gen.with_shapes(shaders.source(SOURCE_FILE), shapes)
    return emulate(text) if emulated else text


class Kernel:
    def __init__(self, wgpu, dev, shapes, emulated=False):
        self.wgpu, self.dev = wgpu, dev
        self.shapes, self.emulated = list(shapes), emulated
        self.module = None  # made on first use: a shader that fails to compile costs its variants only
        self.broken = {}  # variant label -> the error that stopped it (compile or run)
        self.pipes = {}
        self.storage = 0

    def pipeline(self, entry, consts):
        key = (entry,) + tuple(sorted(consts.items()))
        if key not in self.pipes:
            if self.module is None:
                self.module = self.dev.create_shader_module(code=wgsl(self.shapes, self.emulated))
            self.pipes[key] = self.dev.create_compute_pipeline(
                layout="auto", compute={"module": self.module, "entry_point": entry, "constants": consts})
        return self.pipes[key]

    def buf(self, data: bytes = b"", size: int = 0, extra_usage=0):
        U = self.wgpu.BufferUsage
        # at least one 16x16 float32 matrix: Dawn sizes a binding that subgroupMatrixLoad/Store
        # touch by a whole matrix (here only tC and the tiles do; harmless either way)
        n = max(MATRIX_BYTES, (max(len(data), size) + 15) // 16 * 16)
        b = self.dev.create_buffer(size=n, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST | extra_usage)
        if data:
            self.dev.queue.write_buffer(b, 0, bytes(data) + bytes(n - len(data)))
        return b

    def group(self, pipe, bufs):
        entries = [{"binding": k, "resource": {"buffer": bb, "offset": 0, "size": bb.size if s is None else s}}
                   for k, (bb, s) in bufs.items()]
        return self.dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)

    def setup(self, a, b, kmajor, v: Variant, bias=None, act=0, ops=None):
        """The dispatch of C = a @ (b.T if kmajor else b) (+ bias, gelu) with variant ``v``. ``ops``:
        the operand buffers already uploaded (a, b), else uploaded here."""
        M, K = a.shape
        N = b.shape[0] if kmajor else b.shape[1]
        U = self.wgpu.BufferUsage
        abuf, bbuf = ops if ops is not None else (self.buf(a.tobytes()), self.buf(b.tobytes()))
        da, db = int(a.dtype == np.float16), int(b.dtype == np.float16)
        consts = {"B_KMAJOR": bool(kmajor), "BIAS": 1 if bias is not None else 0, "ACT": act,
                  "DTA": da, "DTB": db, "STAGES": v.stages}
        pipe = self.pipeline(v.shape.name, consts)
        uni = self.dev.create_buffer(size=112, usage=U.UNIFORM | U.COPY_DST)
        self.dev.queue.write_buffer(uni, 0, params(M, N, K, K, 1 if kmajor else N, K if kmajor else 1))
        c = self.dev.create_buffer(size=max(MATRIX_BYTES, M * N * 4), usage=U.STORAGE | U.COPY_SRC)
        bufs = {0: (uni, 112), 1: (c, max(MATRIX_BYTES, M * N * 4)), 2: (abuf, None), 3: (bbuf, None),
                4: (self.buf(bias.astype(np.float32).tobytes()) if bias is not None else self.buf(bytes(16)), None)}
        for k in (5, 6, 7):
            bufs[k] = (self.buf(bytes(16)), None)
        return [(pipe, self.group(pipe, bufs), (-(-N // v.shape.bn), -(-M // v.shape.bm), 1))], c, (M, N)

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
    if not np.all(np.isfinite(got)):
        return False, float("nan"), float("nan")
    return bool(np.all(err <= bound)), float(err.max()) if err.size else 0.0, \
        float((err / bound).max()) if err.size else 0.0


CASES = [  # (M, N, K, dtype A, dtype B, kmajor, bias/act)
    (257, 131, 200, np.float16, np.float16, True, False),
    (257, 131, 200, np.float32, np.float16, True, False),
    (300, 260, 68, np.float16, np.float16, False, False),
    (129, 388, 36, np.float32, np.float32, False, False),
    (64, 384, 384, np.float32, np.float16, True, True),
    (1, 7, 4, np.float32, np.float32, True, False),
    # whole tiles, aligned rows; K 80: a partial last K step
    (256, 512, 80, np.float16, np.float16, True, False),
    (256, 512, 96, np.float32, np.float32, False, False),
    (259, 264, 64, np.float16, np.float16, True, True),
    # rows in eights (what the 16-byte-load entries take with float16 operands): n-major B, and a
    # K step only partly filled
    (300, 264, 72, np.float16, np.float16, False, False),
    (131, 136, 40, np.float16, np.float32, True, True),
    # sixteens in M and N (what the direct entries take): partial tiles, bias + gelu and plain
    (144, 272, 72, np.float32, np.float32, True, True),
    (272, 144, 56, np.float16, np.float16, True, False),
    (160, 208, 40, np.float32, np.float32, False, False),
]


def admits(shape: gen.Shape, N, K, da, db, kmaj, M=16) -> bool:
    """Does the entry take this product (ops_sgmat.layout_ok with contiguous operands): K, and N
    where B runs along n, in multiples of each operand's staged load; M and N in sixteens for a
    direct entry (ops_sgmat.direct_ok)."""
    qa, qb = shape.align(da == np.float16), shape.align(db == np.float16)
    return K % qa == 0 and (K if kmaj else N) % qb == 0 and (not shape.direct or (M % 16 == 0 and N % 16 == 0))


def check(k: Kernel, variants) -> list:
    rng = np.random.default_rng(0)
    rows = []
    for v in variants:
        for M, N, K, da, db, kmaj, epi in CASES:
            a = rng.standard_normal((M, K)).astype(da)
            b = rng.standard_normal((N, K) if kmaj else (K, N)).astype(db)
            bias = rng.standard_normal(N).astype(np.float32) if epi else None
            if v.label in k.broken or not admits(v.shape, N, K, da, db, kmaj, M):
                continue
            try:
                s = k.setup(a, b, kmaj, v, bias, 1 if epi else 0)
                k.run(s)
                got = k.read(s)
            except Exception as e:  # a compile error: report it, go on with the other variants
                k.broken[v.label] = f"{type(e).__name__}: {e}"
                print(f"{v.label}: {k.broken[v.label][:3000]}", file=sys.stderr, flush=True)
                rows.append({"case": f"{v.label} (does not run: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__})",
                             "ok": False, "max_err": float("nan"), "worst_ratio": float("nan")})
                continue
            ok, mx, worst = bound_check(got, a, b, kmaj, bias)
            rows.append({"case": f"{v.label} {M}x{N}x{K} A {np.dtype(da).name} B {np.dtype(db).name} "
                                 f"{'k-major' if kmaj else 'n-major'}{' bias+gelu' if epi else ''}",
                         "ok": ok, "max_err": mx, "worst_ratio": worst})
            if not ok:
                print(json.dumps(rows[-1]), flush=True)
    return rows


# The emulation of the subgroup-matrix builtins (--emulate, --dry): the subgroup is invocations
# 32 sg .. 32 sg + 31 of the workgroup and lane l holds row l / 2, columns 8 (l % 2) .. + 7 of a
# result. A left or right matrix is only where it lies (inner array of its tile, offset, stride,
# majorness): each entry's
# multiply-accumulate reads the entry's A and B tiles itself, so the emulation assumes what the
# kernel does anyway, that a tile is not rewritten between a matrix load and its use. Products of
# halves are exact in float32 and summed in float32, which the check's bound allows. Slow, but
# it runs the real indexing, staging and barriers.
EMULATION = """
var<private> emu_lane: u32;
var<private> emu_16: u32;  // 16, as a value the compiler cannot see (loops it need not unroll)
struct SMR { v: array<f32, 8> }
struct SML { r: u32, o: u32, s: u32 }
struct SMRt { r: u32, o: u32, s: u32, col: bool }
"""
EMU_MMA = """
fn mma_{name}(a: SML, b: SMRt, c: SMR) -> SMR {{
    var r = c;
    let row = emu_lane / 2u;
    let c0 = (emu_lane % 2u) * 8u;
    // (n, k) of B at b.o + n * sn + k * sk
    var sn = 1u;
    var sk = b.s;
    if (b.col) {{
        sn = b.s;
        sk = 1u;
    }}
    for (var j = 0u; j < emu_16 / 2u; j++) {{
        var acc = r.v[j];
        for (var k = 0u; k < emu_16; k++) {{
            acc += f32({ta}[a.r][a.o + row * a.s + k]) * f32({tb}[b.r][b.o + (c0 + j) * sn + k * sk]);
        }}
        r.v[j] = acc;
    }}
    return r;
}}
"""


def _entries(src: str):
    """(name, start, end) of each entry point's text in ``src`` (brace-matched)."""
    for m in re.finditer(r"@compute[^\n]*\n\s*fn\s+(\w+)\s*\(", src):
        i = src.index("{", m.end())
        depth = 0
        for j in range(i, len(src)):
            depth += {"{": 1, "}": -1}.get(src[j], 0)
            if depth == 0:
                yield m.group(1), m.start(), j + 1
                break


def emulate(src: str) -> str:
    """``src`` with every subgroup-matrix type and builtin replaced by the emulation above."""
    for line in ("enable chromium_experimental_subgroup_matrix;", "enable subgroups;",
                 "diagnostic(off, chromium.subgroup_matrix_uniformity);"):
        src = src.replace(line, "")
    pre = [EMULATION]
    parts, at = [], 0
    for name, i, j in list(_entries(src)):
        body = src[i:j]
        ta = set(re.findall(r"subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, \w+>\(&(\w+)\[", body))
        tb = set(re.findall(r"subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, \w+>\(&(\w+)\[", body))
        if len(ta) != 1 or len(tb) != 1:
            raise ValueError(f"emulate: {name} loads its matrices from {ta} and {tb}, not one tile each")
        pre.append(EMU_MMA.format(name=name, ta=ta.pop(), tb=tb.pop()))
        parts += [src[at:i], body.replace("subgroupMatrixMultiplyAccumulate(", f"mma_{name}(")]
        at = j
    src = "".join(parts) + src[at:]
    src = src.replace("@builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {",
                      ") {\n    let sg = tid / 32u;\n    let lane = tid % 32u;\n    emu_lane = lane;\n"
                      "    emu_16 = 16u + min(P.M, 0u);")
    src = src.replace("subgroup_matrix_result<f32, 16, 16>()", "SMR()")
    src = re.sub(r"subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>\(&\w+\[(\w+)\], ([^;]*)\);",
                 r"SML(\1, \2);", src)
    src = re.sub(r"subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, (row|col)_major>\(&\w+\[(\w+)\], ([^;]*)\);",
                 lambda m: f"SMRt({m.group(2)}, {m.group(3)}, {'true' if m.group(1) == 'col' else 'false'});", src)
    # the direct entries' result matrices in storage (R loaded, C stored): lane by lane as well
    src = re.sub(r"subgroupMatrixLoad<subgroup_matrix_result<f32, 16, 16>, row_major>\(&(\w+), ([^;]*)\);",
                 r"ld_storage_\1(\2);", src)
    src = re.sub(r"subgroupMatrixStore<row_major>\(&(CF\d?), ([^;]*)\);", r"st_storage_\1(\2);", src)
    for arr in ("R", "CF", "CF1", "CF2"):
        pre.append(f"fn ld_storage_{arr}(o: u32, s: u32) -> SMR {{ var m: SMR; let r = emu_lane / 2u; "
                   f"let c0 = (emu_lane % 2u) * 8u; for (var j = 0u; j < 8u; j++) {{ m.v[j] = {arr}[o + r * s + c0 + j]; }} "
                   f"return m; }}")
        pre.append(f"fn st_storage_{arr}(o: u32, m: SMR, s: u32) {{ let r = emu_lane / 2u; let c0 = (emu_lane % 2u) * 8u; "
                   f"for (var j = 0u; j < 8u; j++) {{ {arr}[o + r * s + c0 + j] = m.v[j]; }} }}")
    stores = set(re.findall(r"subgroupMatrixStore<row_major>\(&(\w+)\[", src))
    src = re.sub(r"subgroupMatrixStore<row_major>\(&(\w+)\[(\w+)\], ", lambda m: f"st_{m.group(1)}({m.group(2)}, ", src)
    src = src.replace("subgroup_matrix_left<f16, 16, 16>", "SML").replace("subgroup_matrix_right<f16, 16, 16>", "SMRt")
    left = re.findall(r".*subgroup_?[mM]atrix.*", src)
    if left or "@builtin(subgroup" in src:
        raise ValueError(f"emulate: builtins left over: {left[:3]}")
    for arr in sorted(stores):
        pre.append(f"fn st_{arr}(g: u32, o: u32, m: SMR, s: u32) {{ let r = emu_lane / 2u; let c0 = (emu_lane % 2u) * 8u; "
                   f"for (var j = 0u; j < 8u; j++) {{ {arr}[g][o + r * s + c0 + j] = m.v[j]; }} }}")
    return src + "\n" + "\n".join(pre) + "\n"


def dry(wgpu, dev, info, variants) -> int:
    """Print the plan and compile every variant's WGSL on this adapter with the matrix builtins
    emulated (Tint checks the rest as written: syntax, types, the uniformity of every barrier,
    workgroup memory)."""
    print("variants:", ", ".join(f"{v.label} ({v.need} B)" for v in variants))
    print("sizes (M x N x K):", ", ".join("x".join(map(str, s)) for s in SHAPES), "; operands float16, float32")
    print(f"adapter {info['adapter']}: workgroup storage {info['workgroup_storage']}")
    k = Kernel(wgpu, dev, {v.shape for v in variants}, emulated=True)
    rc = 0
    for v in variants:
        for consts in ({}, {"B_KMAJOR": False, "DT_OUT": 1, "BIAS": 1, "ACT": 1, "RES": True, "NC": 3}):
            c = dict(consts, STAGES=v.stages, DTA=1)
            if v.need > info["workgroup_storage"]:
                print(f"skipped: {v.label} needs {v.need} bytes of workgroup memory")
                break
            try:
                k.pipeline(v.shape.name, c)
                print(f"compiles (emulated): {v.label} {c}")
            except Exception as e:
                rc = 1
                print(f"FAILS: {v.label} {c}: {str(e)[:3000]}")
    return rc


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
    """One float32 linear (weights [N, K], no bias) per shape: GPU time of its kernels with each
    mode: "exact" (the float kernels), "fast" (the default subgroup-matrix entry) and each forced
    variant."""
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
            # Dawn's timestamps may come in coarse steps: a product shorter than one reads 0
            # (no TFLOP/s then; docs/NOTES.md)
            row[name + "_tflops"] = 2.0 * M * N * K / ms / 1e9 if ms > 0 else float("nan")
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


def _gpu_pass_ms(ctx, encode, reps: int) -> float:
    """GPU ms of ``encode(enc)`` (called ``reps`` times into one command encoder) between two
    timestamps written by empty passes around it, divided by ``reps``."""
    dev = ctx.device
    qs = dev.create_query_set(type="timestamp", count=2)
    enc = dev.create_command_encoder()
    enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0}).end()
    for _ in range(reps):
        encode(enc)
    enc.begin_compute_pass(timestamp_writes={"query_set": qs, "end_of_pass_write_index": 1}).end()
    U = ctx.wgpu.BufferUsage
    rbuf = dev.create_buffer(size=16, usage=U.QUERY_RESOLVE | U.COPY_SRC)
    enc.resolve_query_set(qs, 0, 2, rbuf, 0)
    dev.queue.submit([enc.finish()])
    ticks = np.frombuffer(dev.queue.read_buffer(rbuf), np.uint64)
    rbuf.destroy()
    return float(ticks[1] - ticks[0]) * 1e-6 / reps


def _warm(ctx, encode, seconds: float = 2.0) -> None:
    """Run ``encode`` in passes of 10, each waited for, for ``seconds``: the profile's pass per
    node leaves the GPU mostly idle, and an H100 drops to its idle clock and needs ~2 s of load
    to come back (docs/NOTES.md), which read the whole chain 4x slow in some processes."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        _gpu_pass_ms(ctx, encode, 10)


def _launch_encoder(launches):
    """An encode(enc) that dispatches ``launches`` in one compute pass."""
    def encode(enc):
        cp = enc.begin_compute_pass()
        for L in launches:
            cp.set_pipeline(L.pipeline)
            cp.set_bind_group(0, L.bind_group)
            cp.dispatch_workgroups(*L.workgroups)
        cp.end()
    return encode


def _minilm_program(batch: int, tokens: int):
    """MiniLM-L6 with seeded weights, its program at ``batch`` x ``tokens`` and seeded inputs (ids,
    and a mask that pads the last quarter of the second half of the batch)."""
    import torch

    from gpudelegate.export.models import minilm as mm
    from gpudelegate.export.writer import export_program

    torch.manual_seed(0)
    model = mm.MiniLM(mm.MiniLMConfig()).eval()
    with torch.no_grad():
        prog = export_program(model, mm.example_inputs(batch, tokens), progress=False)
    rng = np.random.default_rng(batch * 1000 + tokens)
    ids = rng.integers(1000, model.cfg.vocab_size, (batch, tokens)).astype(np.int32)
    mask = np.ones((batch, tokens), np.int32)
    mask[batch // 2:, tokens - tokens // 4:] = 0
    return model, prog, ids, mask


def minilm_profile(out, repeat, batch=32, tokens=128, tuning=None) -> int:
    """MiniLM-L6 (seeded weights) at ``batch`` x ``tokens`` with precision="fast" on Dawn, dispatch by
    dispatch: the profile (a pass per node, fastest of several runs), each dispatch alone
    (``repeat`` times back to back in one pass: warm caches, no pass boundaries), the subgroup-matrix
    products alone with their epilogue constants off (BIAS, ACT, RES: what the epilogue costs),
    and the whole chain as the executor encodes it between two timestamps (its true GPU time)."""
    import dataclasses

    from gpudelegate.environment import Environment
    from gpudelegate.webgpu import lowering
    from gpudelegate.webgpu.commands import Launch

    t0 = time.perf_counter()
    _model, prog, ids, mask = _minilm_program(batch, tokens)
    env = Environment(device_options={"dawn": {"toggles": TOGGLES}})
    opts = {"tuning": tuning} if tuning is not None else {}
    rows, lines = [], []
    with env.session(prog, device="dawn", precision="fast", profile=True, **opts) as s:
        ex, ctx = s.executor, s.executor.device
        best = None
        for _ in range(6):
            s.run("forward", [ids, mask])
            got = [sec * 1e3 for _op, _n, sec in ex.last_profile]
            best = got if best is None else [min(a, b) for a, b in zip(best, got)]
        steps = [st for st in ex.recorded[0].nodes if st.launches]
        plan = ex.plan
        per = lowering.select_all(plan.payloads[0], ex.limits, ctx.features, ex.tuning, "payloads[0]",
                                  contiguous=ex._contiguous, fusions=lowering.ops_fused.plan_fusions(plan, 0),
                                  precision=ex.precision, configs=ctx.subgroup_matrix_configs,
                                  subgroup_size=ctx.subgroup_size())
        calls = [c for cs in per for c in cs]
        launches = [L for st in steps for L in st.launches]
        assert len(calls) == len(launches), (len(calls), len(launches))
        by_launch = dict(zip(map(id, launches), calls))
        chain = ex.recorded[0].chain
        _warm(ctx, lambda enc: ctx._encode(chain, enc))
        whole = min(_gpu_pass_ms(ctx, lambda enc: ctx._encode(chain, enc), 1) for _ in range(5))
        whole10 = _gpu_pass_ms(ctx, lambda enc: ctx._encode(chain, enc), 10)
        for st, prof_ms in zip(steps, best):
            alone = _gpu_pass_ms(ctx, _launch_encoder(st.launches * repeat), 1) / repeat
            row = {"node": st.node, "op": st.op, "profile_ms": prof_ms, "alone_ms": alone,
                   "entries": [L.entry.split(":")[-1] for L in st.launches],
                   "workgroups": [list(L.workgroups) for L in st.launches],
                   "labels": [by_launch[id(L)].label for L in st.launches]}
            c = by_launch[id(st.launches[0])]
            if "mm_sgmat" in c.entry:
                row["constants"] = dict(c.constants)
                bare = dataclasses.replace(c, constants=dict(c.constants, BIAS=0, ACT=0, RES=False))
                L = st.launches[0]
                Lb = Launch(ctx.pipeline(bare), L.bind_group, L.workgroups, L.entry)
                row["bare_alone_ms"] = _gpu_pass_ms(ctx, _launch_encoder([Lb] * repeat), 1) / repeat
            rows.append(row)
        by_op: dict = {}
        for r in rows:
            o = by_op.setdefault(r["op"], [0.0, 0.0, 0])
            o[0] += r["profile_ms"]
            o[1] += r["alone_ms"]
            o[2] += 1
    env.close()
    lines += [f"MiniLM {batch}x{tokens} fast on Dawn ({ctx.limits.name}; device toggles "
              f"{__import__('os').environ.get('GPUDELEGATE_DAWN_DEVICE_TOGGLES', '') or 'default'})",
              f"whole chain between two timestamps: {whole:.3f} ms (fastest of 5), {whole10:.3f} ms a run of 10 "
              f"back to back; profile (a pass per node) sum {sum(best):.3f} ms; alone sum "
              f"{sum(r['alone_ms'] for r in rows):.3f} ms", "",
              "| op | dispatches | profile ms | alone ms |", "|---|---|---|---|"]
    lines += [f"| {op} | {n} | {p:.3f} | {a:.3f} |" for op, (p, a, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])]
    lines += ["", "| node | op | entry | workgroups | profile us | alone us | no-epilogue alone us | label |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['node']} | {r['op']} | {','.join(r['entries'])} | {r['workgroups']} | {r['profile_ms'] * 1e3:.1f} | "
              f"{r['alone_ms'] * 1e3:.1f} | {r.get('bare_alone_ms', float('nan')) * 1e3:.1f} | {'; '.join(r['labels'])} |"
              for r in rows]
    _report(lines, f"minilm profile: {time.perf_counter() - t0:.1f} s", out,
            {f"minilm_profile_{batch}x{tokens}.json": json.dumps({"whole_ms": whole, "rows": rows}, indent=1)})
    return 0


def _report(lines, footer: str, out, files: dict) -> None:
    """Print the table ``lines`` and ``footer``; under --out, write ``files`` (name -> text) there
    (a name ending in .md gets the printed text)."""
    text = "\n".join(lines + ["", footer])
    print(text, flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        for name, body in files.items():
            (Path(out) / name).write_text(text + "\n" if name.endswith(".md") else body)


def minilm_attention(out, repeat, shapes, rounds=5) -> int:
    """MiniLM-L6 fast on Dawn, attention on subgroup matrices ("sgmat", the default) against
    attn_tile ("tile"), with eager float32 / float16 alternated in each round (see the module doc).
    Every number is the median over ``rounds`` rounds; the order within a round rotates."""
    import copy
    import os

    import torch

    from gpudelegate.environment import Environment
    from gpudelegate.webgpu.lowering import Tuning

    t0 = time.perf_counter()
    toggles = os.environ.get("GPUDELEGATE_DAWN_DEVICE_TOGGLES", "") or "default"
    env = Environment(device_options={"dawn": {"toggles": TOGGLES}})
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script where there is no GPU
    rows = []
    for b, t in shapes:
        model, prog, ids, mask = _minilm_program(b, t)
        tid, tmask = torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev)
        with torch.no_grad():
            ref = copy.deepcopy(model).double().to(dev)(tid, tmask).cpu().numpy()
        eager = {name: copy.deepcopy(model).to(dt).to(dev) for name, dt in (("fp32", torch.float32), ("fp16", torch.float16))}

        def cos(x):
            x = np.asarray(x, np.float64)
            return float(np.min(np.sum(x * ref, -1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(ref, axis=-1)))

        sessions = {"tile": env.session(prog, device="dawn", precision="fast", tuning=Tuning(attn_sgmat=False)),
                    "sgmat": env.session(prog, device="dawn", precision="fast")}
        row = {"shape": f"{b}x{t}", "toggles": toggles}
        runs, parts = {}, {}
        for name, s in sessions.items():
            got = s.run("forward", [ids, mask])[0]
            row[f"{name}_cos"] = cos(got)
            row[f"{name}_out"] = np.asarray(got, np.float64)
            ex, ctx = s.executor, s.executor.device
            att = [L for st in ex.recorded[0].nodes if st.op == "sdpa" for L in st.launches]
            row[f"{name}_attention_entries"] = sorted({L.entry.split(":")[-1] for L in att})
            chain = ex.recorded[0].chain
            parts[name] = (ctx, chain, att, len([st for st in ex.recorded[0].nodes if st.op == "sdpa"]))
            runs[name] = lambda s=s: s.run("forward", [ids, mask])
        for name, m in eager.items():
            def once(m=m):
                with torch.no_grad():
                    return m(tid, tmask).float().cpu()
            runs[f"eager_{name}"] = once
            row[f"eager_{name}_cos"] = cos(once().numpy())
        row["sgmat_vs_tile_max_abs"] = float(np.max(np.abs(row.pop("sgmat_out") - row.pop("tile_out"))))
        warm_end = time.perf_counter() + 3.0  # the H100 idles at 345 MHz: ~2 s of load to full clock
        while time.perf_counter() < warm_end:
            for fn in runs.values():
                fn()
        got = {k: [] for k in list(runs) + [f"{n}_chain" for n in parts] + [f"{n}_attention" for n in parts]}
        names = list(runs)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                got[name].append(_median_ms(runs[name], repeat))
            for name in (list(parts) if r % 2 == 0 else list(parts)[::-1]):
                ctx, chain, att, n_att = parts[name]
                got[f"{name}_chain"].append(min(_gpu_pass_ms(ctx, lambda enc: ctx._encode(chain, enc), 1) for _ in range(3)))
                # one layer's attention: its dispatches, repeat times back to back in one pass
                got[f"{name}_attention"].append(_gpu_pass_ms(ctx, _launch_encoder(att * repeat), 1) / repeat / n_att)
        for k, v in got.items():
            row[f"{k}_ms"] = float(np.median(v))
        for s in sessions.values():
            s.close()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del eager
    env.close()
    lines = [f"MiniLM-L6 fast on Dawn ({toggles} device toggles): attention on subgroup matrices (sgmat) vs attn_tile "
             f"(tile); medians of {rounds} rounds, order rotated, eager alternated; {repeat} runs / dispatches each", "",
             "| shape | attention us a layer tile / sgmat | chain ms tile / sgmat | run ms tile / sgmat | eager fp32 ms | "
             "eager fp16 ms | sgmat / fp32 eager | sgmat / fp16 eager | cos tile / sgmat / fp16 eager | max abs sgmat - tile | "
             "sgmat entries |", "|" + "---|" * 11]
    lines += [f"| {r['shape']} | {r['tile_attention_ms'] * 1e3:.1f} / {r['sgmat_attention_ms'] * 1e3:.1f} | "
              f"{r['tile_chain_ms']:.3f} / {r['sgmat_chain_ms']:.3f} | {r['tile_ms']:.3f} / {r['sgmat_ms']:.3f} | "
              f"{r['eager_fp32_ms']:.3f} | {r['eager_fp16_ms']:.3f} | {r['eager_fp32_ms'] / r['sgmat_ms']:.2f}x | "
              f"{r['eager_fp16_ms'] / r['sgmat_ms']:.2f}x | {r['tile_cos']:.7f} / {r['sgmat_cos']:.7f} / "
              f"{r['eager_fp16_cos']:.7f} | {r['sgmat_vs_tile_max_abs']:.2g} | {','.join(r['sgmat_attention_entries'])} |"
              for r in rows]
    tag = toggles.replace(",", "_")
    _report(lines, f"minilm attention: {time.perf_counter() - t0:.1f} s", out,
            {f"minilm_attention_{tag}.json": json.dumps(rows, indent=1), f"minilm_attention_{tag}.md": None})
    return 0


def bench(k: Kernel, variants, sizes, repeat: int) -> tuple:
    """Every variant at ``sizes`` with float16 and float32 operands: checked on three 64-row bands
    of C, then timed; cuBLAS float32 and float16 per size in the same process."""
    rows, base = [], {}
    for M, N, K in sizes:
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
            for v in variants:
                if v.label in k.broken:
                    continue
                try:
                    s = k.setup(a, b, True, v, ops=ops)
                    k.run(s)
                    ok, mx, worst = bound_check(k.read(s, bands), a, b, True, rows=bands, ref=ref)
                    ms = k.time_ms(s, repeat)  # timed even when wrong (the table says FAIL)
                except Exception as e:
                    k.broken[v.label] = f"{type(e).__name__}: {e}"
                    print(f"{v.label}: {k.broken[v.label][:3000]}", file=sys.stderr, flush=True)
                    continue
                row = {"shape": sh, "operands": np.dtype(dt).name, "variant": v.label, "ok": ok,
                       "worst_ratio": worst, "ms": ms, "tflops": flop / ms / 1e9}
                for name, bms in base[sh].items():
                    row[f"{name}_tflops"] = flop / bms / 1e9
                    row[f"x_{name}"] = bms / ms
                rows.append(row)
                print(json.dumps(row), flush=True)
            del ops
    return rows, base


def table(info, checks, rows, variants, sizes) -> str:
    nan = float("nan")
    bad = [c for c in checks if not c["ok"]]
    toggles = f"; device toggles {', '.join(info['device_toggles'])}" if info["device_toggles"] else ""
    lines = [f"# subgroup-matrix matmul on {info['adapter']}", "", f"configs: {', '.join(info['configs'])}; "
             f"workgroup storage {info['workgroup_storage']}{toggles}", "",
             f"checks (odd shapes, every layout, bias + gelu): {len(checks) - len(bad)} of {len(checks)} within the "
             f"float16-input bound; worst error/bound {max([c['worst_ratio'] for c in checks if c['worst_ratio'] == c['worst_ratio']] or [nan]):.3f}"
             if checks else "checks: odd shapes skipped (--checks bands); each timed product checked on three bands of C"]
    if bad:
        lines += ["", "| failed check | max err | err / bound |", "|---|---|---|"]
        lines += [f"| {c['case']} | {c['max_err']:.3g} | {c['worst_ratio']:.3f} |" for c in bad]
    if not rows:
        return "\n".join(lines)
    shapes = {v.label: v.shape for v in variants}
    lines += ["", "| variant | tile (subgroups x their block, K step) | size (MxNxK) | operands | TFLOP/s | "
              "vs cuBLAS fp32 | vs cuBLAS fp16 | cuBLAS fp32 | cuBLAS fp16 | ms | check (err/bound) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = [v.label for v in variants]
    names = [f"{m}x{n}x{kk}" for m, n, kk in sizes]
    for r in sorted(rows, key=lambda r: (order.index(r["variant"]), names.index(r["shape"]), r["operands"])):
        s = shapes[r["variant"]]
        tile = f"{s.bm}x{s.bn}: {s.sg_m * s.sg_n} x {s.fm * 16}x{s.fn * 16}, K {s.bk}" + \
            (f", pad {s.pad}" if s.pad != gen.PAD else "") + (f", regs {s.regs}" if s.regs != "raw" else "") + \
            (f", unit {s.unit}" if s.unit != 4 else "") + (f", swz {s.swz}" if s.swz else "")
        lines.append(f"| {r['variant']} | {tile} | {r['shape']} | {r['operands']} | {r['tflops']:.1f} | "
                     f"{r.get('x_cublas_fp32', nan):.2f}x | {r.get('x_cublas_fp16', nan):.2f}x | "
                     f"{r.get('cublas_fp32_tflops', nan):.1f} | {r.get('cublas_fp16_tflops', nan):.1f} | "
                     f"{r['ms']:.3f} | {'ok' if r['ok'] else 'FAIL'} {r['worst_ratio']:.3f} |")
    best = {}
    for r in rows:
        if r["ok"]:
            key = (r["shape"], r["operands"])
            best[key] = max(best.get(key, r), r, key=lambda x: x["tflops"])
    lines += ["", "| size | operands | best variant | TFLOP/s | vs cuBLAS fp32 | vs cuBLAS fp16 |", "|---|---|---|---|---|---|"]
    lines += [f"| {sh} | {dt} | {r['variant']} | {r['tflops']:.1f} | {r.get('x_cublas_fp32', nan):.2f}x | "
              f"{r.get('x_cublas_fp16', nan):.2f}x |" for (sh, dt), r in sorted(best.items(), key=lambda x: (names.index(x[0][0]), x[0][1]))]
    return "\n".join(lines)


def _sizes(text: str) -> list:
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", part.strip())
        if not m:
            raise argparse.ArgumentTypeError(f"--sizes {text!r}: MxNxK,...")
        out.append(tuple(map(int, m.groups())))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for sgmat.json/.md (and minilm.json/.md)")
    ap.add_argument("--repeat", type=int, default=20, help="timed dispatches per variant and size")
    ap.add_argument("--only", default="", help="comma-separated variant labels to run (default: all)")
    ap.add_argument("--tile", action="append", type=parse_tile, default=[],
                    help="NAME:SGM,SGN,FM,FN,BK[,pad=P][,regs=R][,unit=U][,swz=G]: an extra entry point of that shape (repeatable)")
    ap.add_argument("--stages", default="1,2", help="shared stages to run each entry with, where they fit")
    ap.add_argument("--checks", choices=("all", "bands"), default="all",
                    help="bands: skip the odd-shape checks (each timed product is still checked on three "
                         "64-row bands of C against float64)")
    ap.add_argument("--sizes", type=_sizes, default=SHAPES, help="MxNxK,... timed (default: 4096^3 and MiniLM's)")
    ap.add_argument("--device-toggles", default="", help="comma-separated Dawn device toggles (e.g. disable_robustness)")
    ap.add_argument("--minilm", action="store_true", help="MiniLM-L6 through gpudelegate (exact, fast) vs eager")
    ap.add_argument("--minilm-profile", default="",
                    help="BxT: MiniLM-L6 fast on Dawn dispatch by dispatch (profile, alone, epilogue off, whole chain)")
    ap.add_argument("--attention", default="",
                    help="BxT,...: MiniLM-L6 fast, attention on subgroup matrices vs attn_tile, eager alternated")
    ap.add_argument("--rounds", type=int, default=5, help="--attention: alternated rounds")
    ap.add_argument("--minilm-too", action="store_true", help="after the kernel table, --minilm in a second process")
    ap.add_argument("--variants", default="mm_sgmat8",
                    help="--minilm: entries (Tuning.sgmat_entry) run with precision=fast besides the default, comma-separated")
    ap.add_argument("--emulate", action="store_true", help="the checks on any Dawn adapter, matrix builtins emulated")
    ap.add_argument("--dry", action="store_true", help="plan and emulated compile on any Dawn adapter")
    a = ap.parse_args(argv)
    if a.minilm_profile:
        b, t = (int(x) for x in a.minilm_profile.split("x"))
        return minilm_profile(a.out, a.repeat, b, t)
    if a.attention:
        return minilm_attention(a.out, a.repeat, [tuple(int(x) for x in bt.split("x")) for bt in a.attention.split(",")],
                                a.rounds)
    if a.minilm:
        return minilm(a.out, a.repeat, [v for v in a.variants.split(",") if v])
    t0 = time.perf_counter()
    emulated = a.emulate or a.dry
    wgpu, dev, info = open_device([t for t in a.device_toggles.split(",") if t], emulated)
    if isinstance(info, str):
        print(f"bench_sgmat: {info}", file=sys.stderr)
        return 2
    shapes = list(gen.SHAPES) + a.tile
    variants = all_variants(shapes, info["workgroup_storage"], [int(x) for x in a.stages.split(",") if x])
    if a.only:
        keep = [x.strip() for x in a.only.split(",") if x.strip()]
        unknown = set(keep) - {v.label for v in variants}
        if unknown:
            print(f"bench_sgmat: --only {sorted(unknown)}: not among {[v.label for v in variants]}", file=sys.stderr)
            return 2
        variants = [v for v in variants if v.label in keep]
    if a.dry:
        return dry(wgpu, dev, info, variants)
    k = Kernel(wgpu, dev, list(dict.fromkeys(v.shape for v in variants)), emulated)
    k.storage = info["workgroup_storage"]
    checks = check(k, variants) if a.checks == "all" else []
    print(f"checks: {sum(c['ok'] for c in checks)} of {len(checks)} ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    rows, base = ([], {}) if emulated else bench(k, variants, a.sizes, a.repeat)
    text = table(info, checks, rows, variants, a.sizes)
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


if __name__ == "__main__":
    sys.exit(main())
