"""The WGSL lowering (core/webgpu/) against the WGSL it selects (pure Python: no adapter needed).

The browser compiles the same files with Dawn, which is stricter than wgpu-native in two ways
this test pins down: a pipeline constant the entry point does not use is an error, and an
auto-derived layout holds only the bindings the entry point uses. So every entry point's
declared binding slots and overrides (kernel.ENTRIES) must be exactly what a static walk of its
call graph reaches; the uniform structs packed by the lowering must match the WGSL structs' sizes;
and the map kernel's op codes must match the WGSL switch.
"""

from __future__ import annotations

import re
import struct

import pytest

from gpudelegate import ops, shaders
from gpudelegate.shaders import attn_sgmat as attn_sgmat_gen
from gpudelegate.webgpu import kernel, lowering, ops_sgmat
from gpudelegate.plan import fusion
from gpudelegate.plan.types import BufferRef, DeviceLimits, Dispatch, PayloadPlan, TensorRef

_FN = re.compile(r"^fn\s+(\w+)\s*\(", re.M)
_ENTRY = re.compile(r"@compute[^\n]*\n\s*fn\s+(\w+)")
_IDENT = re.compile(r"[A-Za-z_]\w*")


def _functions(src: str) -> dict:
    """name -> text of the function (signature and brace-matched body)."""
    out = {}
    for m in _FN.finditer(src):
        i = src.index("{", m.end())
        depth = 0
        for j in range(i, len(src)):
            depth += {"{": 1, "}": -1}.get(src[j], 0)
            if depth == 0:
                break
        out[m.group(1)] = src[m.start():j + 1]
    return out


def _globals(src: str):
    overrides = set(re.findall(r"^override\s+(\w+)\s*:", src, re.M))
    bindings = {name: int(slot) for slot, name in
                re.findall(r"@binding\((\d+)\)\s*var<[^>]*>\s*(\w+)\s*:", src)}
    wg_vars = {name: decl for name, decl in re.findall(r"^var<workgroup>\s+(\w+)\s*:\s*([^;]+);", src, re.M)}
    return overrides, bindings, wg_vars


def _reach(src: str, entry: str):
    fns = _functions(src)
    overrides, bindings, wg_vars = _globals(src)
    seen, todo, idents = set(), [entry], set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        body = fns[f]
        # Attributes of the entry itself (workgroup_size) sit just above the fn line.
        if f == entry:
            m = re.search(r"@workgroup_size\(([^)]*)\)\s*\n\s*fn\s+" + entry, src)
            body = (m.group(1) if m else "") + body
        for ident in _IDENT.findall(body):
            idents.add(ident)
            if ident in fns and ident != f:
                todo.append(ident)
    for v in list(idents):
        if v in wg_vars:
            idents.update(_IDENT.findall(wg_vars[v]))
    return ({o for o in overrides if o in idents}, {bindings[b] for b in bindings if b in idents})


@pytest.mark.parametrize("entry", sorted(kernel.ENTRIES))
def test_entry_spec_matches_the_wgsl(entry):
    spec = kernel.ENTRIES[entry]
    src = shaders.source(spec.shader)
    assert entry in _ENTRY.findall(src), f"{spec.shader} has no @compute fn {entry}"
    used_overrides, used_slots = _reach(src, entry)
    assert set(spec.overrides) == used_overrides, f"{entry}: declared {sorted(spec.overrides)}, used {sorted(used_overrides)}"
    assert {0, *spec.slots} == used_slots, f"{entry}: declared slots {spec.slots}, used {sorted(used_slots)}"


def _struct_size(src: str, name: str) -> int:
    body = re.search(r"struct\s+" + name + r"\s*\{([^}]*)\}", src).group(1)
    size = 0
    for ty in re.findall(r"^\s*\w+\s*:\s*(.+?),\s*(?://.*)?$", body, re.M):
        ty = ty.strip()
        if ty in ("u32", "i32", "f32"):  # noqa: SIM114
            size += 4
        else:
            n = int(re.match(r"array<vec4<u32>,\s*(\d+)>", ty).group(1))
            size = (size + 15) // 16 * 16 + 16 * n
    return (size + 15) // 16 * 16


def test_map_codes_match_the_wgsl_switch():
    src = shaders.raw_source("elementwise.wgsl")
    body = _functions(src)["map_f"]
    cases = [int(c) for c in re.findall(r"case (\d+)u:", body)]
    assert cases == list(range(len(kernel.MAP_OPS))), cases


LIM = DeviceLimits(name="test")
LIM_SGMAT = DeviceLimits(name="test", max_workgroup_storage=48 * 1024, max_workgroup_invocations=1024)  # NVIDIA's, room for every entry


def _ref(v, dtype, shape, index=0, offset=0):
    from gpudelegate import dtypes

    return TensorRef(v, dtype, tuple(shape), BufferRef("arena", index, offset, dtypes.nbytes(dtype, shape)))


# One dispatch per uniform struct: the packed bytes must have the struct's WGSL size.
_STRUCTS = {"map": "MapParams", "mm": "MMParams", "mm_sgmat": "MMParams", "mm_sgmat8": "MMParams", "mm_sgmat8k": "MMParams", "mm_sgmat8kv": "MMParams", "mm_sgmat8kvs": "MMParams", "mm_sgmat16s": "MMParams", "mm_sgmat8kvd": "MMParams", "mm_sgmat_d": "MMParams", "mm_sgmat_d8": "MMParams", "mm_sgmat_dw": "MMParams", "mm_f32": "MMParams", "mm_f32_4": "MMParams", "mm_f32_sum": "MMParams", "gemv_k": "MMParams", "gemv_n": "MMParams", "conv2d": "ConvParams",
            "pool2d": "ConvParams", "norm_rows": "NormParams", "batch_norm": "NormParams",
            "softmax_rows": "SoftmaxParams", "reduce_rows": "ReduceParams", "embedding": "EmbeddingParams",
            "rope": "RopeParams", "attn_rows": "AttnParams",
            "attn_split": "AttnParams", "attn_combine": "AttnParams", "attn_tile": "TileParams",
            **{s.name: "TileParams" for s in attn_sgmat_gen.SHAPES},
            "qgemv": "QParams", "qgemv_attn": "QParams", "qmm": "QParams", "qmm_sum": "QParams", "qembed": "QEmbedParams",
            "gemv": "MMParams", "gemv_any": "MMParams", "attn_flash": "FlashParams",
            "attn_flash_combine": "FlashParams", "add_rms": "FusedParams", "silu_mul": "FusedParams",
            "rope_kv": "FusedParams", "gemv_cat": "FusedParams", "qgemv_cat": "QParams",
            "gemv_cat_norm": "FusedParams", "qgemv_cat_norm": "QParams", "qgemv_rope": "QParams"}

_SAMPLES = [
    Dispatch(0, "add", {}, [_ref(0, "float32", (5, 3)), _ref(1, "float32", (3,), 1)], [_ref(2, "float32", (5, 3), 2)]),
    Dispatch(0, "linear", {}, [_ref(0, "float32", (7, 3)), _ref(1, "float32", (5, 3), 1)], [_ref(2, "float32", (7, 5), 2)]),
    Dispatch(0, "linear", {}, [_ref(0, "float32", (1, 3)), _ref(1, "float32", (5, 3), 1)], [_ref(2, "float32", (1, 5), 2)]),
    Dispatch(0, "matmul", {}, [_ref(0, "float32", (1, 3)), _ref(1, "float32", (3, 5), 1)], [_ref(2, "float32", (1, 5), 2)]),
    # a decode linear with a float16 weight whose rows are whole 16-byte chunks: gemv.wgsl's gemv
    Dispatch(0, "linear", {}, [_ref(0, "float32", (1, 8)), _ref(1, "float16", (5, 8), 1)], [_ref(2, "float32", (1, 5), 2)]),
    # float32 with K, N multiples of 4 and enough output for 8x8 per thread: matmul_fast.wgsl's mm_f32
    Dispatch(0, "matmul", {}, [_ref(0, "float32", (2048, 4)), _ref(1, "float32", (4, 2048), 1)],
             [_ref(2, "float32", (2048, 2048), 2)]),
    # a 128-token prefill's linear: too few 8x8-per-thread tiles, mm_f32_4
    Dispatch(0, "linear", {}, [_ref(0, "float32", (128, 64)), _ref(1, "float32", (64, 64), 1)],
             [_ref(2, "float32", (128, 64), 2)]),
    # ... with K = 256: split-K in 4 (mm_f32_4 partials, mm_f32_sum)
    Dispatch(0, "linear", {}, [_ref(0, "float32", (128, 256)), _ref(1, "float32", (64, 256), 1)],
             [_ref(2, "float32", (128, 64), 2)]),
    Dispatch(0, "conv2d", {}, [_ref(0, "float32", (1, 2, 5, 5)), _ref(1, "float32", (3, 2, 3, 3), 1)],
             [_ref(2, "float32", (1, 3, 3, 3), 2)]),
    Dispatch(0, "max_pool2d", {"kernel": [2, 2]}, [_ref(0, "float32", (1, 2, 4, 4))], [_ref(2, "float32", (1, 2, 2, 2), 2)]),
    Dispatch(0, "rms_norm", {}, [_ref(0, "float32", (3, 4))], [_ref(2, "float32", (3, 4), 2)]),
    Dispatch(0, "batch_norm", {}, [_ref(0, "float32", (1, 2, 3)), _ref(1, "float32", (2,), 1), _ref(3, "float32", (2,), 3)],
             [_ref(2, "float32", (1, 2, 3), 2)]),
    Dispatch(0, "softmax", {}, [_ref(0, "float32", (3, 4))], [_ref(2, "float32", (3, 4), 2)]),
    Dispatch(0, "sum", {"dims": [1]}, [_ref(0, "float32", (3, 4))], [_ref(2, "float32", (3,), 2)]),
    Dispatch(0, "embedding", {}, [_ref(0, "float32", (9, 4)), _ref(1, "int32", (3,), 1)], [_ref(2, "float32", (3, 4), 2)]),
    Dispatch(0, "sdpa", {}, [_ref(0, "float32", (1, 2, 1, 4)), _ref(1, "float32", (1, 2, 3, 4), 1),
                             _ref(3, "float32", (1, 2, 3, 4), 3)], [_ref(2, "float32", (1, 2, 1, 4), 2)]),
    Dispatch(0, "rope", {}, [_ref(0, "float32", (1, 1, 3, 4)), _ref(1, "float32", (3, 4), 1), _ref(3, "float32", (3, 4), 3)],
             [_ref(2, "float32", (1, 1, 3, 4), 2)]),
    # a prefill's attention (more than 16 query rows, at most 128 keys): attention_tile.wgsl's attn_tile
    Dispatch(0, "sdpa", {}, [_ref(0, "float32", (1, 2, 20, 4)), _ref(1, "float32", (1, 2, 20, 4), 1),
                             _ref(3, "float32", (1, 2, 20, 4), 3)], [_ref(2, "float32", (1, 2, 20, 4), 2)]),
    # packed GGUF weights (ops_quant.py): a decode linear (qgemv), a prefill one split along K
    # (qmm, qmm_sum), a gather (qembed)
    Dispatch(0, "linear", {}, [_ref(0, "float32", (1, 64)), _ref(1, "q4_0", (5, 64), 1)], [_ref(2, "float32", (1, 5), 2)]),
    Dispatch(0, "linear", {}, [_ref(0, "float32", (17, 256)), _ref(1, "q8_0", (5, 256), 1)], [_ref(2, "float32", (17, 5), 2)]),
    Dispatch(0, "embedding", {}, [_ref(0, "q4_1", (9, 32)), _ref(1, "int32", (3,), 1)], [_ref(2, "float32", (3, 32), 2)]),
]


def _fused_sample_calls():
    """The calls of the planner's fused groups (ops_fused.py): add + rms_norm, gate/up as one
    concatenated product with silu * up, rope + a cache write, a lone silu * x; then the same
    gate/up taking the add + rms_norm as its prologue (float and packed weights)."""
    f = "float32"

    def res(v, shape, i):
        return TensorRef(v, f, tuple(shape), BufferRef("resident", i, 0, 4 * shape[0] * shape[1]))

    x, y, s, h = _ref(0, f, (1, 8)), _ref(1, f, (1, 8), 1), _ref(2, f, (1, 8), 2), _ref(3, f, (1, 8), 3)
    wg, wu = res(4, (4, 8), 0), res(5, (4, 8), 1)
    g, u, a, o = _ref(6, f, (1, 4), 4), _ref(7, f, (1, 4), 5), _ref(8, f, (1, 4), 6), _ref(9, f, (1, 4), 7)
    k4, kc, pos = _ref(10, f, (1, 1, 1, 4), 8), _ref(11, f, (1, 1, 5, 4), 9), _ref(12, "int32", (1,), 10)
    cos, sin, kr = _ref(13, f, (1, 4), 11), _ref(14, f, (1, 4), 12), _ref(15, f, (1, 1, 1, 4), 13)
    sg, z = _ref(16, f, (1, 8), 14), _ref(17, f, (1, 8), 15)
    ds = [Dispatch(0, "add", {}, [x, y], [s]), Dispatch(1, "rms_norm", {"eps": 1e-5}, [s], [h]),
          Dispatch(2, "linear", {}, [h, wg], [g]), Dispatch(3, "linear", {}, [h, wu], [u]),
          Dispatch(4, "silu", {}, [g], [a]), Dispatch(5, "mul", {}, [a, u], [o]),
          Dispatch(6, "rope", {}, [k4, cos, sin], [kr]), Dispatch(7, "kv_update", {}, [kc, kr, pos], [kc]),
          Dispatch(8, "silu", {}, [y], [sg]), Dispatch(9, "mul", {}, [sg, x], [z])]
    pp = PayloadPlan(0, None, ds, [x, y, k4, kc, pos, cos, sin], [s, o, kc, z])
    plain = {"add_rms_norm", "silu_mul", "rope_kv", "gemm_cat"}
    fs = fusion.match(pp, 0, {(0, 4): 0, (0, 5): 1}, contiguous=[(0, 1)], kinds=plain)
    out = [c for calls in lowering.select_all(pp, LIM, fusions=fs) for c in calls]
    fs = fusion.match(pp, 0, {(0, 4): 0, (0, 5): 1}, contiguous=[(0, 1)])
    assert [f.norm is not None for f in fs if f.cat] == [True]
    out += [c for calls in lowering.select_all(pp, LIM, fusions=fs) for c in calls]
    # gate/up with packed weights: one qgemv_cat (quant_mm.wgsl) for both products and silu * up
    xq, gq, uq, aq, oq = (_ref(20 + i, f, (1, 32) if i == 0 else (1, 4), i) for i in range(5))
    wq = [TensorRef(25 + i, "q4_1", (4, 32), BufferRef("resident", i, 0, 80)) for i in range(2)]
    dq = [Dispatch(0, "linear", {}, [xq, wq[0]], [gq]), Dispatch(1, "linear", {}, [xq, wq[1]], [uq]),
          Dispatch(2, "silu", {}, [gq], [aq]), Dispatch(3, "mul", {}, [aq, uq], [oq])]
    ppq = PayloadPlan(0, None, dq, [xq], [oq])
    fq = fusion.match(ppq, 0, {(0, 25): 0, (0, 26): 1}, contiguous=[(0, 1)])
    out += [c for calls in lowering.select_all(ppq, LIM, fusions=fq) for c in calls]
    # the same with x = rms_norm(a + b): one qgemv_cat_norm
    aq, bq, sq = (_ref(30 + i, f, (1, 32), 8 + i) for i in range(3))
    dn = [Dispatch(0, "add", {}, [aq, bq], [sq]), Dispatch(1, "rms_norm", {"eps": 1e-5}, [sq], [xq])] + dq
    ppn = PayloadPlan(0, None, dn, [aq, bq], [sq, oq])
    fn = fusion.match(ppn, 0, {(0, 25): 0, (0, 26): 1}, contiguous=[(0, 1)])
    assert [f.norm is not None for f in fn if f.cat] == [True]
    return out + [c for calls in lowering.select_all(ppn, LIM, fusions=fn) for c in calls] + _packed_front_calls() \
        + _attn_product_calls()


def _attn_product_calls():
    """A decode attention (2 heads of 16 on 1 kv head, 5 keys) into a packed product: the
    planner's sdpa_linear, attn_flash then qgemv_attn."""
    f = "float32"
    q, k, v = _ref(60, f, (1, 2, 1, 16), 20), _ref(61, f, (1, 1, 5, 16), 21), _ref(62, f, (1, 1, 5, 16), 22)
    y, x, o = _ref(63, f, (1, 2, 1, 16), 23), _ref(64, f, (1, 1, 32), 23), _ref(65, f, (1, 1, 4), 24)
    w = TensorRef(66, "q4_1", (4, 32), BufferRef("resident", 20, 0, 80))
    ds = [Dispatch(0, "sdpa", {}, [q, k, v], [y]), Dispatch(1, "reshape", {"shape": [1, 1, 32]}, [y], [x]),
          Dispatch(2, "linear", {}, [x, w], [o])]
    pp = PayloadPlan(0, None, ds, [q, k, v], [o])
    fs = fusion.match(pp)
    assert [f.kind for f in fs] == ["sdpa_linear"]
    return [c for calls in lowering.select_all(pp, LIM, fusions=fs) for c in calls]


def _packed_front_calls():
    """A decode attention front on packed weights: add + rms_norm, q / k / v (2, 1, 1 heads of 4),
    q and k rotated, k and v into their caches; every tensor but the weights in one arena buffer,
    as the one qgemv_rope dispatch binds them."""
    f = "float32"

    def at(v, shape, off, dt=f):
        from gpudelegate import dtypes

        return TensorRef(v, dt, tuple(shape), BufferRef("arena", 50, off, dtypes.nbytes(dt, shape)))

    a, b, s, h = (at(40 + i, (1, 32), 256 * i) for i in range(4))
    ws = [TensorRef(44 + i, "q4_1", (n, 32), BufferRef("resident", 10 + i, 0, 20 * n)) for i, n in enumerate((8, 4, 4))]
    lin = [at(47 + i, (1, n), 1024 + 256 * i) for i, n in enumerate((8, 4, 4))]
    cos, sin, pos = at(50, (1, 4), 1792), at(51, (1, 4), 2048), at(52, (1,), 2304, "int32")
    kc, vc = at(53, (1, 1, 5, 4), 2560), at(54, (1, 1, 5, 4), 2816)
    qr, kr = at(55, (1, 2, 1, 4), 3072), at(56, (1, 1, 1, 4), 3328)
    ds = [Dispatch(0, "add", {}, [a, b], [s]), Dispatch(1, "rms_norm", {"eps": 1e-5}, [s], [h])]
    heads = []
    for i, (w, lo, H) in enumerate(zip(ws, lin, (2, 1, 1))):
        v1, v2 = TensorRef(60 + 2 * i, f, (1, 1, H, 4), lo.buf), TensorRef(61 + 2 * i, f, (1, H, 1, 4), lo.buf)
        ds += [Dispatch(2 + 3 * i, "linear", {}, [h, w], [lo]),
               Dispatch(3 + 3 * i, "reshape", {"shape": [1, 1, H, 4]}, [lo], [v1]),
               Dispatch(4 + 3 * i, "reshape", {"shape": [1, H, 1, 4]}, [v1], [v2])]
        heads.append(v2)
    ds += [Dispatch(11, "rope", {}, [heads[0], cos, sin], [qr]), Dispatch(12, "rope", {}, [heads[1], cos, sin], [kr]),
           Dispatch(13, "kv_update", {}, [kc, kr, pos], [kc]), Dispatch(14, "kv_update", {}, [vc, heads[2], pos], [vc])]
    pp = PayloadPlan(0, None, ds, [a, b, cos, sin, pos, kc, vc], [s, qr, kc, vc])
    fs = fusion.match(pp, 0, {(0, 44): 10, (0, 45): 11, (0, 46): 12}, contiguous=[(10, 11, 12)])
    calls = [c for cs in lowering.select_all(pp, LIM, fusions=fs) for c in cs]
    assert [c.entry for c in calls] == ["qgemv_rope"], [c.entry for c in calls]
    return calls


def test_uniform_bytes_match_the_wgsl_structs():
    seen = set()
    # sdpa also without flash-decoding and split-K (attn_split/attn_combine, attn_rows), linear
    # also on the older gemv kernels (gemv_k/gemv_n), for the kernels they otherwise replace.
    runs = [(d, lowering.Tuning()) for d in _SAMPLES] + \
        [(d, lowering.Tuning(attn_flash=False, attn_split=split)) for d in _SAMPLES if d.op == "sdpa"
         for split in (True, False)] + \
        [(d, lowering.Tuning(gemv_old=True)) for d in _SAMPLES if d.op == "linear"]
    for d, tuning in runs:
        for c in lowering.select(d, LIM, tuning=tuning):
            struct_name = _STRUCTS[c.entry]
            assert len(c.uniform) == _struct_size(shaders.source(c.shader), struct_name), (c.entry, len(c.uniform))
            seen.add(c.entry)
    for c in _fused_sample_calls():
        assert len(c.uniform) == _struct_size(shaders.source(c.shader), _STRUCTS[c.entry]), (c.entry, len(c.uniform))
        seen.add(c.entry)
    # subgroup-matrix products (ops_sgmat.py): a device with the feature and precision="fast"
    sg_features = ("shader-f16", "subgroups", "chromium-experimental-subgroup-matrix")
    sg_configs = ({"component": "f16", "result": "f32", "M": 16, "N": 16, "K": 16},)
    for d in _SAMPLES:
        for e in (sorted(ops_sgmat.ENTRY_POINTS) if d.op in ("linear", "matmul") else ()):
            for c in lowering.select(d, LIM_SGMAT, sg_features, lowering.Tuning(sgmat_entry=e), "fast", sg_configs):
                assert len(c.uniform) == _struct_size(shaders.source(c.shader), _STRUCTS[c.entry]), c.entry
                seen.add(c.entry)
    # prefill attention on subgroup matrices (ops_attention.py): head dims of 16 or 32 each
    for s in attn_sgmat_gen.SHAPES:
        att = Dispatch(0, "sdpa", {}, [_ref(0, "float32", (1, 2, 20, 16 * s.dk)), _ref(1, "float32", (1, 2, 20, 16 * s.dk), 1),
                                       _ref(2, "float32", (1, 2, 20, 16 * s.dv), 2)], [_ref(3, "float32", (1, 2, 20, 16 * s.dv), 3)])
        for c in lowering.select(att, LIM_SGMAT, sg_features, lowering.Tuning(attn_sgmat_min_groups=1), "fast",
                                 sg_configs):
            assert len(c.uniform) == _struct_size(shaders.source(c.shader), _STRUCTS[c.entry]), c.entry
            seen.add(c.entry)
    assert seen == set(kernel.ENTRIES), f"entries without a sample: {set(kernel.ENTRIES) - seen}"


def test_every_op_has_a_lowering():
    assert set(ops.KERNEL_OPS) == set(lowering.SUPPORTED_OPS)


def test_bindings_are_aligned_and_within_the_tensor():
    lim = DeviceLimits(max_binding_size=1 << 20, offset_alignment=256, name="t")
    # A tensor at an offset that is not a multiple of the alignment (float16 at 2 mod 4 would be
    # refused; 64 mod 256 is bound at 0 with an element base of 16).
    d = Dispatch(0, "neg", {}, [_ref(0, "float32", (7,), 0, 64)], [_ref(1, "float32", (7,), 1, 512)])
    (c,) = lowering.select(d, lim)
    outb = next(b for b in c.bindings if b.binding == 1)
    inb = next(b for b in c.bindings if b.binding == 2)
    assert (inb.buf.offset, inb.buf.nbytes) == (0, 64 + 28) and (outb.buf.offset, outb.buf.nbytes) == (512, 28)
    # Element bases in the uniform: out_base 0, base0 16.
    vals = struct.unpack_from("<12I", c.uniform)
    assert vals[5] == 0 and vals[6] == 16


def test_unsupported_op_is_refused():
    from gpudelegate.errors import UnsupportedOpError

    with pytest.raises(UnsupportedOpError, match="no WGSL kernel"):
        lowering.select(Dispatch(0, "delegate", {"payload": 0}, [], [_ref(0, "float32", (1,))]), LIM)


def test_split_k_choice():
    x, w, o = _ref(0, "float32", (128, 1536)), _ref(1, "float32", (576, 1536), 1), _ref(2, "float32", (128, 576), 2)
    calls = lowering.select(Dispatch(0, "linear", {}, [x, w], [o]), LIM)
    assert [c.entry for c in calls] == ["mm_f32_4", "mm_f32_sum"]
    assert calls[0].constants["KSPLIT"] == 8 and calls[0].workgroups == (18, 4, 8)
    # K too short to split (each split keeps >= 64).
    x, w, o = _ref(0, "float32", (128, 96)), _ref(1, "float32", (1536, 96), 1), _ref(2, "float32", (128, 1536), 2)
    (c,) = lowering.select(Dispatch(0, "linear", {}, [x, w], [o]), LIM)
    assert c.entry == "mm_f32_4" and c.constants["KSPLIT"] == 1
