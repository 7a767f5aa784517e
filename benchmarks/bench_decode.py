"""Decode and prefill of SmolLM2-135M with packed (GGUF block) weights, on every executor, against
PyTorch on the same dequantized weights: one run, one table, recorded under benchmarks/results/.

    python benchmarks/bench_decode.py [--out DIR] [--small] [--sections gemv,models,compile]

Seeded random weights everywhere (real weights cannot travel to the GPU machine, and speed does
not depend on their values), drawn like a fresh model's and then quantized the way the SmolLM2
GGUF is (Q4_1 linears, a Q8_0 embedding that is also the tied LM head): the torch module holds the
dequantized values, so every program and every anchor computes with the very same weights.

1. **gemv** (CUDA): achieved GB/s of the packed dequantizing GEMV (``native/cuda_quant.py``) on
   SmolLM2's decode shapes (576x576, 192x576, 1536x576, 576x1536 Q4_1; 49152x576 Q8_0), and of
   cuBLAS on float16 / float32 weights of the same shapes, and of ``hgemv`` (float16 weights
   against float32 activations, ``shaders/cuda_gemv.cu``), against a device-to-device copy
   measured in the same run (the bound: read + write bytes per second). Each row replays, from
   one CUDA graph, enough distinct copies of the weight to overflow the L2 cache several times,
   so the bytes come from HBM; rows of a few hundred KB are bound by the launches, not by memory.
   q4_1 rows time qgemv41x (``native/cuda_qgemv_fast.py``: nibbles read as exact denormal floats,
   the default from 2^22 weights and for 1 or 2 x rows), qgemv41 (the default otherwise) and the
   staged qgemv, on the same weights in the same process; the variant rows time each kernel's
   template choices (staged: rows per warp R, words U; qgemv41: R, groups a trip S, warps a row
   KS, split sums; qgemv41x: S, KS, warps a block W, R, shared bytes; ``--gemv-variants fast``
   times qgemv41x's only, ``none`` none); at an 8B model's MLP shapes 2 and 8 x rows as well.
   The sweep rows replay one decode step's linears of all 30 layers and the LM head (q4_1 also
   with qgemv41x forced and through the staged qgemv).
2. **models**: the module exported with ``weights_dtype`` float32 and float16 and as the GGUF mix
   (q4_1, through ``export_program(..., packed_weights=...)``), run on ``cuda`` (CUDA graphs),
   ``wgpu`` and ``dawn`` (where the environment has such a device; skipped with the reason
   otherwise): prefill of one 128-token chunk (latency, logits read back), greedy decode (tok/s
   over 64 steps after 2 warm-up steps, KV cache left on the device, the argmax read back each
   step), dispatches per decode step and the host time of ``session.run`` per step; against
   PyTorch eager (float32, and float16 for the float16 and packed programs) on the GPU, same
   weights, a static KV cache (``bench_cuda.torch_llama``). Prefill logits are checked against
   PyTorch float32 on every executor.
   With ``--lookahead host,0,1,2`` each of those sessions also times greedy decode through
   ``gpudelegate.llm.generate`` (the token picked on the device, ``lookahead`` steps submitted
   before the host reads the token they follow; ``host``: the host picks from the read-back
   logits), one row per value next to the greedy decode row, with the ratio to it.
   ``--devices cuda,wgpu`` and ``--weights q4_1`` keep a run to those rows.
3. **compile**: ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) of the float16 anchor,
   against ours on CUDA; last, since its compile time is the least predictable part.

``--small`` (2 layers, vocabulary 8192, 16-token prefill, 4 decode steps) runs in about a minute
on a software adapter (lavapipe) and the numpy reference executor, so the script itself is
checked where there is no GPU: its numbers say nothing about speed, CUDA rows are skipped with
the reason.
"""

from __future__ import annotations

import importlib.util
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _import_gpudelegate():
    """Import the package, from the source tree when it is not installed (the GPU machine gets a
    copy of the working tree)."""
    try:
        import gpudelegate  # noqa: F401
        return
    except ImportError:
        pass
    layout = {"gpudelegate": "core", "gpudelegate.native": "native", "gpudelegate.shaders": "shaders",
              "gpudelegate.web": "web", "gpudelegate.export": "export"}
    for name, folder in layout.items():
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)


_import_gpudelegate()

import gpudelegate  # noqa: E402
from gpudelegate.errors import DeviceError, UnsupportedOpError  # noqa: E402
from gpudelegate.text.ids import IdsTokenizer  # noqa: E402

import bench_cuda as bc  # noqa: E402  (torch_llama, step_inputs: the PyTorch anchor with a static KV cache)
from bench_report import Report, finish, parse_args, result_writer, section  # noqa: E402

COLUMNS = [("section", "section"), ("metric", "metric"), ("ours", "gpudelegate"), ("baseline", "baseline"),
           ("ratio", "ours / baseline"), ("note", "note")]

# (label, N, K, packed dtype) of one SmolLM2 decode step's linears (weights [N, K])
GEMV_SHAPES = [("q / o", 576, 576, "q4_1"), ("k / v", 192, 576, "q4_1"), ("gate / up", 1536, 576, "q4_1"),
               ("down", 576, 1536, "q4_1"), ("LM head", 49152, 576, "q8_0"),
               # an 8B model's MLP products: large enough that the bytes, not a kernel's latency,
               # set the time, so "% of the copy" says how well the kernel streams
               ("8B gate / up", 14336, 4096, "q4_1"), ("8B down", 4096, 14336, "q4_1"),
               # square products between those: where qgemv41x starts to pay
               ("8B q / o", 4096, 4096, "q4_1"), ("1B q / o", 2048, 2048, "q4_1")]
LAYER_LINEARS = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
L2_FLUSH = 256 << 20  # bytes of distinct weights a GEMV row streams per replay (the H100's L2 is 50 MB)
MAX_COPIES = 4096

# float32 / q4_1 programs compute in float32 like the float32 anchor; float16 weights add one
# rounding per weight (2^-11)
LOGITS_TOL = {"float32": 1e-3, "q4_1": 1e-3, "float16": 2e-2}


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _ratio(a: Optional[float], b: Optional[float], higher_better: bool = True) -> str:
    if not a or not b:
        return ""
    return f"{a / b:.2f}x" if higher_better else f"{b / a:.2f}x speed"


def _cuda():
    """CuPy where a CUDA device answers, else (None, why)."""
    try:
        from gpudelegate.native.cuda_executor import import_cupy
        return import_cupy(), ""
    except DeviceError as e:
        return None, str(e)


# ============================================================================ the model

def model_config(small: bool):
    from gpudelegate.export.models import smollm2

    if small:
        return smollm2.SmolLM2Config(layers=2, vocab_size=8192, max_context=64, prefill_chunk=16)
    # a 128-token chunk, then 2 + 64 decode steps: all inside a 256-row cache
    return smollm2.SmolLM2Config(max_context=256, prefill_chunk=128)


def random_model(cfg, seed: int = 0):
    """Our SmolLM2 module with seeded weights of a fresh model's scale (N(0, 0.02), norms in
    [0.5, 1.5]), then quantized as the GGUF is: returns (module holding the dequantized values,
    packed_weights for export_program: {weight_key: (dtype, blocks)})."""
    import torch

    from gpudelegate.export.models import smollm2
    from gpudelegate.native import quant

    torch.manual_seed(seed)
    m = smollm2.SmolLM2(cfg).eval()
    packed = {}
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
                continue
            p.normal_(0.0, 0.02)
            dt = "q8_0" if name == "embed_tokens.weight" else "q4_1"
            w = p.detach().numpy()
            blocks = quant.quantize(dt, w)
            deq = quant.dequantize(dt, blocks, w.shape)
            p.copy_(torch.from_numpy(deq))
            packed[quant.weight_key(deq)] = (dt, blocks)
    return m, packed


def export_programs(model, cfg, packed, weights=("float32", "float16", "q4_1")) -> Tuple[Dict[str, object], Dict[str, str]]:
    """{weights: program} for float32, float16 and the GGUF mix ("q4_1") (those in ``weights``),
    and why any is missing."""
    import torch

    from gpudelegate.export.frontend import export_method
    from gpudelegate.export.models import smollm2
    from gpudelegate.export.writer import export_program

    names = smollm2.cache_names(cfg)
    t0 = time.perf_counter()
    with torch.no_grad():  # torch.export once (a third of an export's time); each weights dtype lowers it
        methods = {"prefill": export_method(smollm2.Prefill(model), smollm2.example_inputs(cfg, "prefill")),
                   "decode": export_method(smollm2.Decode(model), smollm2.example_inputs(cfg, "decode"))}
    print(f"    torch.export {time.perf_counter() - t0:.1f} s", flush=True)
    # metadata["llm"]: the layout gpudelegate.llm.generate reads (the --lookahead rows)
    meta = {"llm": {"max_context": cfg.max_context, "prefill_chunk": cfg.prefill_chunk, "layers": cfg.layers,
                    "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
                    "cache_dtype": "float32", "caches": names}}
    kw = dict(progress=False, input_names={"prefill": ["ids", "pos", "last", *names], "decode": ["ids", "pos", *names]},
              output_names={m: ["logits", *names] for m in methods}, metadata=meta)
    progs, missing = {}, {}
    for wd in weights:
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                if wd == "q4_1":
                    progs[wd] = export_program(methods, weights_dtype="float32", packed_weights=packed, **kw)
                else:
                    progs[wd] = export_program(methods, weights_dtype=wd, **kw)
        except Exception as e:  # an export without packed weights (TypeError / ExportError): say so
            traceback.print_exc()
            missing[wd] = f"export failed: {type(e).__name__}: {str(e)[:120]}"
            continue
        p = progs[wd]
        stored = {}
        for c in p.constants:
            stored[c.dtype] = stored.get(c.dtype, 0) + c.nbytes
        print(f"    export {wd}: {time.perf_counter() - t0:.1f} s, constants "
              + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(stored.items())), flush=True)
    return progs, missing


def torch_weights(model, cfg) -> Tuple[object, Dict[str, np.ndarray]]:
    """bench_cuda's LlamaConfig and weight names for our module (same math: rms norm, half-rotation
    rope, GQA attention, SiLU MLP, tied embedding)."""
    lc = bc.LlamaConfig(vocab=cfg.vocab_size, dim=cfg.hidden, layers=cfg.layers, heads=cfg.heads,
                        kv_heads=cfg.kv_heads, hidden=cfg.intermediate, max_ctx=cfg.max_context,
                        theta=cfg.rope_theta, eps=cfg.rms_eps)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w = {"embed": sd["embed_tokens.weight"], "norm": sd["norm.weight"]}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        w.update({f"l{i}.in_norm": sd[p + "input_layernorm.weight"], f"l{i}.post_norm": sd[p + "post_attention_layernorm.weight"],
                  f"l{i}.q": sd[p + "self_attn.q_proj.weight"], f"l{i}.k": sd[p + "self_attn.k_proj.weight"],
                  f"l{i}.v": sd[p + "self_attn.v_proj.weight"], f"l{i}.o": sd[p + "self_attn.o_proj.weight"],
                  f"l{i}.gate": sd[p + "mlp.gate_proj.weight"], f"l{i}.up": sd[p + "mlp.up_proj.weight"],
                  f"l{i}.down": sd[p + "mlp.down_proj.weight"]})
    return lc, w


# ============================================================================ running one side

class Workload:
    def __init__(self, cfg, small: bool):
        self.cfg = cfg
        self.chunk = cfg.prefill_chunk
        self.n_dec = 4 if small else 64
        self.reps = 1 if small else 10
        rng = np.random.default_rng(5)
        self.prompt = rng.integers(100, cfg.vocab_size, (1, self.chunk)).astype(np.int32)


def parse_lookahead(text: str) -> list:
    """``--lookahead`` "host,0,1,2" as generate's values: "host" is None (the host picks from the
    read-back logits), an int k picks on the device with k steps submitted ahead."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "host":
            out.append(None)
        elif item.isdigit():
            out.append(int(item))
        else:
            raise SystemExit(f"--lookahead: {item!r} is neither 'host' nor an int >= 0")
    return out


def time_generate(s, wl: Workload, lookaheads) -> dict:
    """Greedy decode tok/s through ``gpudelegate.llm.generate`` for each lookahead (None: "host"):
    ``wl.n_dec`` decode steps over the wall time of a generation of ``wl.n_dec + 1`` tokens less
    that of a 1-token one (the prompt's prefill and first pick), medians of 3 (1 with --small)
    after a warm-up. Not GenerationResult's decode_seconds: with k steps ahead, the first k
    steps are submitted (on a synchronous executor: run) before the first token is read, inside
    its prefill time. Also whether every lookahead gave the same ids."""
    from gpudelegate.llm import generate

    tok = IdsTokenizer()
    prompt = [int(x) for x in wl.prompt.reshape(-1)]
    reps = 1 if wl.reps == 1 else 3

    def wall(n: int, la):
        t = time.perf_counter()
        r = generate(s, tok, prompt, max_new_tokens=n, stop_ids=(), lookahead=la)
        return time.perf_counter() - t, r.ids

    out, ids = {}, {}
    for la in lookaheads:
        wall(3, la)  # warm-up (CUDA: the first decode run captures its graph)
        first = statistics.median(wall(1, la)[0] for _ in range(reps))
        runs = [wall(wl.n_dec + 1, la) for _ in range(reps)]
        key = "host" if la is None else la
        out[key] = wl.n_dec / max(statistics.median(t for t, _ in runs) - first, 1e-9)
        ids[key] = runs[0][1]
    return {"tok_s": out, "same_ids": len({tuple(v) for v in ids.values()}) <= 1}


def run_ours(env, prog, device: str, wl: Workload, cp=None, lookaheads=(), **opts) -> dict:
    """Prefill latency, greedy decode tok/s, host time of run() per step and dispatches per step
    of one session (the prefill's logits kept for the check); with ``lookaheads``, greedy decode
    through ``gpudelegate.llm.generate`` for each (``time_generate``)."""
    from gpudelegate.export.models import smollm2

    cfg = wl.cfg
    names = smollm2.cache_names(cfg)
    shape = (1, cfg.kv_heads, cfg.max_context, cfg.head_dim)
    zeros = [np.zeros(shape, np.float32) for _ in names]
    pos0, last = np.array([0], np.int32), np.array([wl.chunk - 1], np.int32)
    t0 = time.perf_counter()
    s = env.session(prog, device=device, **opts)
    build = time.perf_counter() - t0
    try:
        def argmax(t) -> int:
            if cp is not None and device == "cuda":
                return int(cp.argmax(t.handle))  # on the device, one int read back (as torch does)
            return int(np.argmax(t.numpy()))

        out = s.run("prefill", [wl.prompt, pos0, last, *zeros], keep_on_device=True)
        logits0 = out[0].numpy().reshape(-1).astype(np.float32)
        caches = out[1:]
        times = []
        for _ in range(wl.reps + 1):  # the caches fed back stay on the device (no upload)
            t = time.perf_counter()
            out = s.run("prefill", [wl.prompt, pos0, last, *caches], keep_on_device=True)
            out[0].numpy()  # waits for the GPU
            times.append(time.perf_counter() - t)
            caches = out[1:]
        prefill = statistics.median(times[1:])
        tok = argmax(out[0])
        host = 0.0
        for i in range(wl.n_dec + 2):  # 2 warm-up steps (the first one captures the CUDA graph)
            if i == 2:
                t_start = time.perf_counter()
                host = 0.0
            t = time.perf_counter()
            out = s.run("decode", [np.array([[tok]], np.int32), np.array([wl.chunk + i], np.int32), *out[1:]],
                        keep_on_device=True)
            host += time.perf_counter() - t
            tok = argmax(out[0])
        dec = wl.n_dec / (time.perf_counter() - t_start)
        pid = prog.methods["decode"].nodes[0].attrs["payload"]
        gen = time_generate(s, wl, lookaheads) if lookaheads else None
        return {"build_s": build, "prefill_s": prefill, "decode_tok_s": dec, "host_ms_per_step": host / wl.n_dec * 1e3,
                "dispatches": _dispatches(s, device, pid), "logits0": logits0, "generate": gen,
                "greedy_lookahead": getattr(s.executor, "greedy_lookahead", None)}
    finally:
        s.close()


def _dispatches(s, device: str, pid: int) -> str:
    """Kernel dispatches one decode run makes, as the executor records them."""
    ex = s.executor
    try:
        if device == "cuda":  # bound steps after fusion: a fused group is one step, whatever it
            # launches, and no-op reshapes count too (probe_cuda_graph.py counts the kernels)
            return f"{sum(1 for f in ex._states[pid].steps if f is not None)} bound steps"
        if hasattr(ex, "recorded"):  # the WebGPU executor: launches of every recorded node
            return str(sum(len(n.launches) for n in ex.recorded[pid].nodes))
        return str(len(s.plan.payloads[pid].dispatches))  # the reference: one per planned dispatch
    except Exception as e:  # an executor whose internals moved: the row still stands
        return f"? ({type(e).__name__})"


def _per_step(dispatches: str) -> str:
    """What _dispatches counted, with its unit: WebGPU's dispatches, or CUDA's bound steps."""
    return dispatches if "bound" in dispatches else f"{dispatches} dispatches"


def run_torch(torch, model_cfg, weights, dtype, dev, wl: Workload, compiled: bool = False) -> dict:
    """The same prefill + greedy decode on bench_cuda.torch_llama (eager or compiled)."""
    m = bc.torch_llama(model_cfg, weights, dtype, dev)
    fwd = torch.compile(m, mode="reduce-overhead", dynamic=False) if compiled else m
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    to_t = lambda ins: [torch.from_numpy(a.astype(np.int64) if a.dtype == np.int32 else a).to(dev)
                        for a in (ins[0], ins[1], ins[3])]
    tin = to_t(bc.step_inputs(model_cfg, list(wl.prompt[0]), 0))
    res = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(3 if compiled else 1):  # compile + record the graphs of both shapes
            y = fwd(*tin)
            fwd(*to_t(bc.step_inputs(model_cfg, [1], wl.chunk)))
        sync()
        res["warmup_s"] = time.perf_counter() - t0
        times = []
        for _ in range(wl.reps + 1):
            t = time.perf_counter()
            y = fwd(*tin)
            y.float().cpu()
            times.append(time.perf_counter() - t)
        res["prefill_s"] = statistics.median(times[1:])
        res["logits0"] = y.float().cpu().numpy().reshape(-1)
        tok = int(y.argmax())
        for i in range(wl.n_dec + 2):
            if i == 2:
                sync()
                t_start = time.perf_counter()
            y = fwd(*to_t(bc.step_inputs(model_cfg, [tok], wl.chunk + i)))
            tok = int(y.argmax())
        res["decode_tok_s"] = wl.n_dec / (time.perf_counter() - t_start)
    del fwd, m
    return res


# ============================================================================ sections

def bench_gemv(rep: Report, env, small: bool, variants: str = "all") -> None:
    cp, why = _cuda()
    if cp is None:
        rep.row("gemv", "packed GEMV GB/s", "skipped", "", "", why)
        return
    from gpudelegate.native import quant
    from gpudelegate.native.cuda_qgemv_fast import FastQ41
    from gpudelegate.native.cuda_quant import PackedView, gemv_launch

    ctx = env.context("cuda")
    kern = ctx.kernels
    stream = cp.cuda.Stream(non_blocking=True)
    flush = (32 << 20) if small else L2_FLUSH

    def gpu_seconds(fn, reps: int = 5) -> float:
        """Median GPU time of ``fn()`` (work enqueued on ``stream``), between events."""
        with stream:
            fn()
            stream.synchronize()
            ts = []
            for _ in range(reps):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(stream)
                fn()
                b.record(stream)
                b.synchronize()
                ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
        return statistics.median(ts)

    def graph_of(fns):
        with stream:
            stream.begin_capture()
            try:
                for f in fns:
                    f()
            finally:
                g = stream.end_capture()
        return g

    # the bound: a device-to-device copy (read + write bytes)
    n = flush
    src, dst = cp.empty(n, np.uint8), cp.empty(n, np.uint8)
    src.fill(1)
    copy_s = gpu_seconds(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, 3, stream.ptr))
    bound = 2 * n / copy_s / 1e9
    del src, dst
    rep.row("gemv", f"device-to-device copy, {n >> 20} MiB", f"{bound:.0f} GB/s", "", "", "the bound (read + write)")
    rep.data["copy_gbps"] = bound
    rng = np.random.default_rng(0)
    results = {}

    def rotated_row(label, N, K, kind, blocks=None, m=1, xdt=None):
        """GB/s of m-row products over enough distinct copies of one weight to overflow L2
        (``xdt``: the activations' dtype, by default the weight's, float32 for packed ones)."""
        if kind in ("q4_0", "q4_1", "q8_0"):
            nbytes = blocks.nbytes
        else:
            nbytes = N * K * np.dtype(kind).itemsize
        stride = -(-nbytes // 256) * 256
        copies = max(1, min(MAX_COPIES, -(-flush // nbytes)))
        dev = cp.empty((copies, stride), np.uint8)
        if blocks is not None:
            dev[:, :nbytes] = cp.asarray(blocks.reshape(-1))[None, :]
            ws = [PackedView(kind, (N, K), dev[i, :nbytes]) for i in range(copies)]
            xdt = np.float32
        else:
            w = cp.asarray((rng.standard_normal((N, K)) * 0.02).astype(kind))
            dev[:, :nbytes] = w.reshape(-1).view(np.uint8)[None, :]
            ws = [cp.ndarray((N, K), dtype=kind, memptr=dev[i].data) for i in range(copies)]
            xdt = kind if xdt is None else xdt
        x = cp.asarray(rng.standard_normal((m, K)).astype(xdt))
        out = cp.empty((m, N), xdt)
        fns = [kern.linear(x, w, None, out, "bench") for w in ws]
        g = graph_of(fns)
        sec = gpu_seconds(lambda: g.launch(stream)) / copies
        del g, fns, ws, dev
        return nbytes / sec / 1e9, sec

    for label, N, K, qt in GEMV_SHAPES:
        if small:
            N = max(32, N // 8)
        w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
        blocks = quant.quantize(qt, w)
        row = {}
        for kind in (qt, "float16", "float32"):
            gbps, sec = rotated_row(label, N, K, kind, blocks if kind == qt else None)
            row[kind] = (gbps, sec)
        # a float16 weight against float32 activations: hgemv (cuda_gemv.cu), not cuBLAS
        row["hgemv"] = rotated_row(label, N, K, "float16", None, xdt=np.float32)
        lp = gemv_launch(qt, N, K, 1, kern.sm_count)
        g, sec = row[qt]
        how = (f"qgemv41 S{lp.steps} KS{lp.split_k}" if lp.direct else f"{lp.words} words/lane")
        if lp.direct:  # qgemv41x and qgemv41 (one of them the default) and the staged qgemv, same weight
            fx = kern.quant.fast.launch(N, K, 1)  # the device's choice (its SM count, shared memory)
            picked = "qgemv41x" if FastQ41.applies(N, K, 1) else "qgemv41"
            other = "qgemv41" if picked == "qgemv41x" else "qgemv41x"
            kern.quant.fast.enabled = other == "qgemv41x"
            try:
                row[other] = rotated_row(label, N, K, qt, blocks)
                kern.quant.fast.enabled = False
                kern.quant.gemv_direct = False
                row["staged"] = rotated_row(label, N, K, qt, blocks)
            finally:
                kern.quant.gemv_direct = None
                kern.quant.fast.enabled = None
            row[picked] = row[qt]
            xg, xsec = row["qgemv41x"]
            og, osec = row["qgemv41"]
            how = (f"{picked}; qgemv41x S{fx.steps} KS{fx.split_k} W{fx.warps} R{fx.rows_per_warp} {fx.chunks} "
                   f"chunk(s) {xg:.0f} GB/s, {xsec * 1e6:.1f} us = {osec / xsec:.2f}x qgemv41's speed (S{lp.steps} "
                   f"KS{lp.split_k} {og:.0f} GB/s, {osec * 1e6:.1f} us); staged qgemv {row['staged'][0]:.0f} GB/s, "
                   f"{row['staged'][1] * 1e6:.1f} us")
        rep.row("gemv", f"{label} {N}x{K} {qt}, 1 row", f"{g:.0f} GB/s ({sec * 1e6:.1f} us)", f"{bound:.0f} GB/s copy",
                f"{100 * g / bound:.0f}%",
                how + ("" if lp.direct else f", {lp.rows_per_warp} row(s)/warp, {lp.grid} blocks")
                + f"; cuBLAS fp16 {row['float16'][0]:.0f} GB/s ({row['float16'][1] * 1e6:.1f} us), "
                f"fp32 {row['float32'][0]:.0f} GB/s ({row['float32'][1] * 1e6:.1f} us)")
        gh, sh = row["hgemv"]
        rep.row("gemv", f"{label} {N}x{K} float16 weight, float32 x, 1 row (hgemv)", f"{gh:.0f} GB/s ({sh * 1e6:.1f} us)",
                f"{bound:.0f} GB/s copy", f"{100 * gh / bound:.0f}%", "cuda_gemv.cu: the float16 bytes read once")
        results[label] = {k: {"gbps": v[0], "us": v[1] * 1e6} for k, v in row.items()}
        best = None
        if variants != "none" and label in ("q / o", "down", "LM head", "gate / up", "8B gate / up", "8B down",
                                            "8B q / o"):
            # the kernel's variants: staged qgemv (rows per warp R, staged words U) and for q4_1
            # qgemv41x (groups of 16 blocks a trip S, warps a row KS, warps a block W, shared bytes
            # for the staged activations) and qgemv41 (R, groups of 8 blocks a trip S, warps a row
            # group KS, "split": d * sum(q x) + m * sum(x))
            q = kern.quant
            var = {}
            knobs = [] if variants == "fast" else [
                (f"R{r}/U{u}", dict(gemv_direct=False, gemv_rows_per_warp=r, gemv_words=u))
                for r, u in ((1, 4), (2, 4), (4, 4), (1, 8), (2, 8), (4, 8))]
            if qt == "q4_1":
                knobs += [(f"fast S{st}/KS{ks}/W{wp}/R{r}/{sm >> 10}K",
                           dict(enabled=True, steps=st, split_k=ks, warps=wp, rows_per_warp=r, smem=sm))
                          for st, ks, wp, r, sm in ((2, 1, 8, 2, 36 << 10), (2, 1, 32, 1, 96 << 10),
                                                    (2, 1, 32, 1, 36 << 10), (2, 1, 16, 2, 96 << 10),
                                                    (2, 1, 16, 2, 36 << 10), (2, 1, 16, 1, 36 << 10),
                                                    (1, 1, 16, 1, 36 << 10), (4, 1, 16, 1, 36 << 10),
                                                    (2, 2, 16, 1, 36 << 10), (1, 1, 8, 2, 36 << 10),
                                                    (2, 1, 4, 2, 36 << 10))]
            if qt == "q4_1" and variants == "all":
                knobs += [(f"direct R{r}/S{st}/KS{ks}{'/split' if sp else ''}",
                           dict(gemv_direct=True, gemv_rows_per_warp=r, gemv_steps=st, gemv_split_k=ks, gemv_split=sp))
                          for r, st, ks in ((1, 2, 1), (1, 4, 1), (1, 2, 2), (1, 4, 2), (1, 1, 4), (1, 2, 4),
                                            (2, 2, 1), (2, 2, 2))
                          for sp in (0, 1)]
            for name, kv in knobs:
                for a_, v_ in kv.items():
                    setattr(q.fast if name.startswith("fast") else q, a_, v_)
                try:
                    var[name] = rotated_row(label, N, K, qt, blocks)
                finally:
                    q.gemv_direct = q.gemv_rows_per_warp = q.gemv_words = q.gemv_steps = q.gemv_split_k = None
                    q.gemv_split = 0
                    q.fast.steps = q.fast.split_k = q.fast.warps = q.fast.smem = None
                    q.fast.rows_per_warp = q.fast.enabled = None
            best = max(var, key=lambda k: var[k][0]) if var else None
        if best is not None:
            rep.row("gemv", f"{label} {N}x{K} {qt}, 1 row: qgemv variants", f"{var[best][0]:.0f} GB/s ({best})",
                    f"{bound:.0f} GB/s copy", f"{100 * var[best][0] / bound:.0f}%",
                    ", ".join(f"{k} {v[1] * 1e6:.1f} us" for k, v in var.items()))
            results[label + " variants"] = {k: {"gbps": v[0], "us": v[1] * 1e6} for k, v in var.items()}
        if label == "LM head":  # 8 x rows: the weight is still read once
            g8, sec8 = rotated_row(label, N, K, qt, blocks, m=8)
            rep.row("gemv", f"{label} {N}x{K} {qt}, 8 rows", f"{g8:.0f} GB/s ({sec8 * 1e6:.1f} us)",
                    f"{bound:.0f} GB/s copy", f"{100 * g8 / bound:.0f}%", f"{sec8 / sec:.2f}x the 1-row time")
            results[label + " 8 rows"] = {qt: {"gbps": g8, "us": sec8 * 1e6}}
        if label in ("8B gate / up", "8B down"):  # 2 and 8 x rows through qgemv41x and qgemv41
            for m in (2, 8):
                kern.quant.fast.enabled = True
                try:
                    gm, secm = rotated_row(label, N, K, qt, blocks, m=m)
                    kern.quant.fast.enabled = False
                    om, osecm = rotated_row(label, N, K, qt, blocks, m=m)
                finally:
                    kern.quant.fast.enabled = None
                fm = kern.quant.fast.launch(N, K, m)
                rep.row("gemv", f"{label} {N}x{K} {qt}, {m} rows (qgemv41x)",
                        f"{gm:.0f} GB/s ({secm * 1e6:.1f} us)", f"{bound:.0f} GB/s copy", f"{100 * gm / bound:.0f}%",
                        f"S{fm.steps} KS{fm.split_k} W{fm.warps} {fm.chunks} chunk(s); {secm / row['qgemv41x'][1]:.2f}x "
                        f"its 1-row time; qgemv41 {om:.0f} GB/s ({osecm * 1e6:.1f} us = {osecm / secm:.2f}x)")
                results[f"{label} {m} rows"] = {"qgemv41x": {"gbps": gm, "us": secm * 1e6},
                                                "qgemv41": {"gbps": om, "us": osecm * 1e6}}
    rep.data["gemv"] = results

    # one decode step's linears: every layer's weights distinct, back to back in one graph
    layers = 4 if small else 30
    V = 8192 if small else 49152
    shapes = [(N, K, "q4_1") for N, K in LAYER_LINEARS] + [(V, 576, "q8_0")]
    # one random matrix per shape, uploaded once per layer: distinct addresses are what keeps the
    # bytes out of L2 (their values do not matter)
    host = {(N, K): (rng.standard_normal((N, K)) * 0.02).astype(np.float32) for N, K, _ in shapes}
    blocks = {(N, K): quant.quantize(qt, host[N, K]) for N, K, qt in shapes}
    sweep = {}
    for kind in ("q4_1", "q4_1 qgemv41x", "q4_1 staged", "float16", "float32", "hgemv"):
        wdt = "float16" if kind == "hgemv" else kind  # hgemv: float16 weights, float32 activations
        ws, total = [], 0
        kern.quant.gemv_direct = False if kind == "q4_1 staged" else None  # the staged qgemv for q4_1 too
        kern.quant.fast.enabled = True if kind == "q4_1 qgemv41x" else None  # forced, or where it applies
        for N, K, qt in shapes:
            for _ in range(layers if qt == "q4_1" else 1):
                if kind.startswith("q4_1"):
                    d = cp.asarray(blocks[N, K].reshape(-1))
                    ws.append((PackedView(qt, (N, K), d), K, N))
                else:
                    d = cp.asarray(host[N, K].astype(wdt))
                    ws.append((d, K, N))
                total += d.nbytes
        xdt = np.float32 if kind in ("q4_1", "q4_1 qgemv41x", "q4_1 staged", "hgemv") else kind
        xs = {K: cp.asarray(rng.standard_normal((1, K)).astype(xdt)) for K in (576, 1536)}
        outs = {N: cp.empty((1, N), xdt) for N in {N for _, _, N in ws}}
        try:
            g = graph_of([kern.linear(xs[K], w, None, outs[N], "bench") for w, K, N in ws])
        finally:
            kern.quant.gemv_direct = None
            kern.quant.fast.enabled = None
        sec = gpu_seconds(lambda: g.launch(stream))
        sweep[kind] = (total, sec)
        del g, ws
    tq, sq = sweep["q4_1"]
    rep.row("gemv", f"decode step's linears, {layers} layers + LM head, q4_1 + q8_0 head",
            f"{tq / sq / 1e9:.0f} GB/s ({sq * 1e6:.0f} us, {tq / 1e6:.1f} MB)", f"{bound:.0f} GB/s copy",
            f"{100 * tq / sq / 1e9 / bound:.0f}%",
            f"{len(LAYER_LINEARS) * layers + 1} launches; cuBLAS fp16 {sweep['float16'][0] / sweep['float16'][1] / 1e9:.0f} "
            f"GB/s ({sweep['float16'][1] * 1e6:.0f} us), fp32 {sweep['float32'][0] / sweep['float32'][1] / 1e9:.0f} GB/s "
            f"({sweep['float32'][1] * 1e6:.0f} us): packed {sweep['float16'][1] / sq:.2f}x fp16's speed; q4_1 with "
            f"qgemv41x forced {sweep['q4_1 qgemv41x'][1] * 1e6:.0f} us, through the staged qgemv "
            f"{sweep['q4_1 staged'][1] * 1e6:.0f} us")
    th, sh = sweep["hgemv"]
    rep.row("gemv", f"decode step's linears, {layers} layers + LM head, float16 weights, float32 x (hgemv)",
            f"{th / sh / 1e9:.0f} GB/s ({sh * 1e6:.0f} us, {th / 1e6:.1f} MB)", f"{bound:.0f} GB/s copy",
            f"{100 * th / sh / 1e9 / bound:.0f}%", f"{len(LAYER_LINEARS) * layers + 1} launches")
    rep.data["gemv_sweep"] = {k: {"bytes": v[0], "us": v[1] * 1e6} for k, v in sweep.items()}


def bench_models(rep: Report, env, small: bool, lookaheads=(), only_devices=None, only_weights=None) -> None:
    import torch

    cp, why_cuda = _cuda()
    cfg = model_config(small)
    wl = Workload(cfg, small)
    t0 = time.perf_counter()
    model, packed = random_model(cfg)
    print(f"    model + quantization {time.perf_counter() - t0:.1f} s", flush=True)
    progs, missing = export_programs(model, cfg, packed, tuple(only_weights or ("float32", "float16", "q4_1")))
    lc, tw = torch_weights(model, cfg)
    dev = torch.device("cuda" if cp is not None and torch.cuda.is_available() else "cpu")
    label = "SmolLM2-135M" if not small else "SmolLM2 2-layer (small)"
    rep.data["_ctx"] = {"lc": lc, "tw": tw, "wl": wl, "dev": dev, "label": label}

    # the anchors first: every row of ours is printed against them
    anchors = {}
    for dt in (("float32", "float16") if dev.type == "cuda" else ("float32",)):
        t_dt = torch.float32 if dt == "float32" else torch.float16
        anchors[dt] = run_torch(torch, lc, tw, t_dt, dev, wl)
        a = anchors[dt]
        rep.row("anchor", f"{label}, PyTorch eager {dt} ({dev.type}): prefill {wl.chunk} / decode",
                f"{_fmt_ms(a['prefill_s'])} / {a['decode_tok_s']:.0f} tok/s", "", "",
                f"bench_cuda.torch_llama, static KV cache, weights {dt} (dequantized values)")
    rep.data["anchors"] = {k: {kk: vv for kk, vv in v.items() if kk != "logits0"} for k, v in anchors.items()}
    gold = anchors["float32"]["logits0"]

    devices = [("cuda", {"capture_graph": True}), ("wgpu", {}), ("dawn", {})]
    if small:
        devices.append(("reference", {}))
    if only_devices:
        devices = [d for d in devices if d[0] in only_devices]
    rep.data["ours"] = {}
    best_cuda = {}
    for device, opts in devices:
        if device == "cuda" and cp is None:
            rep.row(device, f"{label}", "skipped", "", "", why_cuda)
            continue
        try:
            env.context(device)
        except DeviceError as e:
            rep.row(device, f"{label}", "skipped", "", "", str(e)[:160])
            continue
        for wd in only_weights or ("float32", "float16", "q4_1"):
            if wd not in progs:
                rep.row(device, f"{label} {wd}", "skipped", "", "", missing.get(wd, ""))
                continue
            try:
                r = run_ours(env, progs[wd], device, wl, cp=cp, lookaheads=lookaheads, **opts)
            except UnsupportedOpError as e:  # an executor without kernels for these weights: a fact, not a failure
                rep.row(device, f"{label} {wd}", "unsupported", "", "", str(e)[:160])
                continue
            except Exception as e:  # one executor x weights failing leaves the other rows
                traceback.print_exc()
                rep.errors.append(f"{device} {wd}: {type(e).__name__}: {e}")
                rep.row(device, f"{label} {wd}", "FAILED", "", "", f"{type(e).__name__}: {str(e)[:160]}")
                continue
            anchor_dt = "float32" if wd == "float32" or "float16" not in anchors else "float16"
            a = anchors[anchor_dt]
            err = bc.rel_err(r["logits0"], gold)
            ok = "ok" if err < LOGITS_TOL[wd] else "CHECK"
            mode = " (graphs)" if opts.get("capture_graph") else ""
            rep.row(device, f"{label} {wd}{mode}: prefill {wl.chunk} tokens", _fmt_ms(r["prefill_s"]),
                    f"{_fmt_ms(a['prefill_s'])} torch eager {anchor_dt}", _ratio(r["prefill_s"], a["prefill_s"], False),
                    f"prefill logits vs torch fp32: rel err {err:.1e} ({ok}); build {r['build_s']:.1f} s")
            rep.row(device, f"{label} {wd}{mode}: greedy decode", f"{r['decode_tok_s']:.0f} tok/s",
                    f"{a['decode_tok_s']:.0f} tok/s torch eager {anchor_dt}", _ratio(r["decode_tok_s"], a["decode_tok_s"]),
                    f"{wl.n_dec} steps; {_per_step(r['dispatches'])}/step; host {r['host_ms_per_step']:.3f} ms/step in run()")
            gen = r.get("generate")
            for la, tps in (gen["tok_s"].items() if gen else ()):
                rep.row(device, f"{label} {wd}{mode}: greedy generate, lookahead {la}", f"{tps:.0f} tok/s",
                        f"{r['decode_tok_s']:.0f} tok/s greedy decode row", _ratio(tps, r["decode_tok_s"]),
                        f"gpudelegate.llm.generate, {wl.n_dec} steps (wall time less a 1-token generate's), "
                        f"median of {1 if wl.reps == 1 else 3}; "
                        f"auto = {r['greedy_lookahead']}; ids equal across lookaheads: {gen['same_ids']}")
            if gen and not gen["same_ids"]:
                rep.errors.append(f"{device} {wd}: greedy ids differ between lookaheads {list(gen['tok_s'])}")
            if ok != "ok":
                rep.errors.append(f"{device} {wd}: prefill logits rel err {err:.1e} over {LOGITS_TOL[wd]}")
            rep.data["ours"][f"{device} {wd}"] = {k: v for k, v in r.items() if k != "logits0"} | {"logits_rel_err": err}
            if device == "cuda":
                best_cuda[wd] = r
    rep.data["_ctx"]["cuda"] = best_cuda


def bench_compile(rep: Report, env, small: bool) -> None:
    import torch

    ctx = rep.data.pop("_ctx", None)
    if ctx is None:
        rep.row("compile", "torch.compile", "skipped", "", "", "the models section did not run")
        return
    if ctx["dev"].type != "cuda":
        rep.row("compile", "torch.compile(mode='reduce-overhead')", "skipped", "", "",
                "needs CUDA (reduce-overhead replays CUDA graphs)")
        return
    wl, label = ctx["wl"], ctx["label"]
    r = run_torch(torch, ctx["lc"], ctx["tw"], torch.float16, ctx["dev"], wl, compiled=True)
    rep.data["torch_compile_fp16"] = {k: v for k, v in r.items() if k != "logits0"}
    rep.row("compile", f"{label}, torch.compile fp16 (reduce-overhead): prefill / decode",
            f"{_fmt_ms(r['prefill_s'])} / {r['decode_tok_s']:.0f} tok/s", "", "", f"compile + capture {r['warmup_s']:.0f} s")
    for wd, o in ctx["cuda"].items():
        rep.row("compile", f"cuda {wd} (graphs) vs torch.compile fp16: decode", f"{o['decode_tok_s']:.0f} tok/s",
                f"{r['decode_tok_s']:.0f} tok/s", _ratio(o["decode_tok_s"], r["decode_tok_s"]))
        rep.row("compile", f"cuda {wd} (graphs) vs torch.compile fp16: prefill {wl.chunk}", _fmt_ms(o["prefill_s"]),
                _fmt_ms(r["prefill_s"]), _ratio(o["prefill_s"], r["prefill_s"], False))


# ============================================================================ main

def _extra_options() -> "argparse.ArgumentParser":
    import argparse

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--lookahead", default="",
                    help="models: also time greedy decode through gpudelegate.llm.generate for each of these "
                         "lookaheads (e.g. host,0,1,2; 'host': the host picks from the read-back logits)")
    ap.add_argument("--devices", default="", help="models: only these executors (e.g. cuda,wgpu,dawn)")
    ap.add_argument("--weights", default="", help="models: only these weights (float32,float16,q4_1)")
    ap.add_argument("--gemv-variants", default="all", choices=("all", "fast", "none"),
                    help="gemv: time every kernel's variants (all), qgemv41x's only (fast) or none")
    return ap


def main(argv=None) -> int:
    extra = _extra_options()
    mine, rest = extra.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(extra.format_help().replace("usage: ", "more options: ", 1))
    args = parse_args(rest, __doc__, "decode", "--small",
                      "2 layers, short prompt: checks the script on a software adapter and the reference executor",
                      "gemv,models,compile")
    lookaheads = parse_lookahead(mine.lookahead)
    only_devices = [d for d in mine.devices.split(",") if d]
    only_weights = [w for w in mine.weights.split(",") if w]
    want = args.sections.split(",")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    env = gpudelegate.Environment()
    cp, why = _cuda()
    names, versions = [], [f"torch {torch.__version__}"]
    if cp is not None:
        info = env.context("cuda").info()
        names.append(info["device"])
        versions.append(f"cupy {info['cupy']}, CUDA runtime {info['cuda_runtime']}")
    try:
        winfo = env.context("wgpu").info()
        if not names:
            names.append(winfo["device"])
        versions.append(f"wgpu adapter {winfo['device']}")
    except DeviceError as e:
        print(f"no wgpu: {e}")
    device = names[0] if names else platform.processor() or "cpu"
    print(f"device: {device}; " + "; ".join(versions), flush=True)
    if "llvmpipe" in device.lower() or "cpu" in device.lower():
        print("NOTE: a software (CPU) adapter: the numbers say nothing about GPU speed", flush=True)
    rep = Report(COLUMNS)
    rep.data["device"] = {"name": device, "versions": versions, "small": args.small, "python": platform.python_version()}
    write = result_writer(rep, args.out, "decode", device, "--small" if args.small else "",
                          "Packed-weight decode benchmark", ", ".join(versions))
    steps = {"gemv": lambda: bench_gemv(rep, env, args.small, mine.gemv_variants),
             "models": lambda: bench_models(rep, env, args.small, lookaheads, only_devices, only_weights),
             "compile": lambda: bench_compile(rep, env, args.small)}
    for name in want:
        if name not in steps:
            print(f"unknown section {name!r} (known: {', '.join(steps)})")
            return 2
        section(rep, name, steps[name])
        write()
    env.close()
    return finish(rep, write)


if __name__ == "__main__":
    sys.exit(main())
