"""to_backend with preprocess_all (seed PR 9811), the partitioner, the gpudelegate backend's
constant sharing / prepack / offload schedule, host fallback, the writer and the CLI.

Numerical checks run the program on the reference executor against torch in float64:
float32 weights to 2e-5 relative to max |ref| (see test_export_frontend), float16-stored weights
to 5e-3 (each weight is rounded to 11 significant bits, 2^-11 = 4.9e-4 relative, and the ~100-term
dot products here add such errors with random signs).
"""

from __future__ import annotations

import copy
import os
from typing import Dict, List

import numpy as np
import pytest
import torch
from torch import nn

import gpudelegate
from gpudelegate.errors import ExportError
from gpudelegate.export import (BackendDetails, DelegateCandidate, ExportGraph, GpuDelegateBackend,
                                GpuDelegatePartitioner, NoPartitioner, Partition, Partitioner, export_method,
                                export_program, lower, save_program, to_backend)
from gpudelegate.export.partitioner import contiguous_runs
from gpudelegate.program import DELEGATE_OP, Payload, Program, Value
from gpudelegate.program import Node as PNode
from test_export_frontend import FP32_TOL, assert_close, rnd, run_reference, torch_float64

FP16_TOL = 5e-3
TOY = ("relu", "sigmoid")


# ------------------------------------------------------------------------------ models

class Gated(nn.Module):
    """linear -> relu -> linear -> sigmoid * x: two toy-backend runs between gpudelegate runs."""

    def __init__(self, d=13, h=29):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return torch.sigmoid(self.fc2(torch.relu(self.fc1(x)))) * x


class Score(nn.Module):
    def __init__(self, gated: Gated):
        super().__init__()
        self.g = gated

    def forward(self, x):
        return torch.relu(self.g.fc1(x)).sum(-1)


# ------------------------------------------------------------------------------ a second backend

class ToyBackend(BackendDetails):
    """Records its preprocess_all calls; its payloads are the partition graphs as they are
    (constants read directly, no prepack), which the reference executor runs like any payload."""

    backend_id = "toy"

    def __init__(self):
        self.calls: List[Dict[str, List[DelegateCandidate]]] = []

    def preprocess_all(self, program: Program, candidates):
        self.calls.append(candidates)
        out = {}
        for method, cands in candidates.items():
            out[method] = []
            for c in cands:
                g = c.graph
                values = [Value(v.dtype, v.shape, name=v.name,
                                constant=program.add_constant(v.dtype, v.shape, v.data) if v.is_constant else None)
                          for v in g.values]
                nodes = [PNode(n.op, list(n.args), list(n.outputs), dict(n.attrs)) for n in g.nodes]
                out[method].append(Payload(values, list(g.inputs), list(g.outputs), nodes, backend="toy"))
        return out


class RecordingGpuBackend(GpuDelegateBackend):
    def __init__(self):
        super().__init__()
        self.calls = []

    def preprocess_all(self, program, candidates):
        self.calls.append(candidates)
        return super().preprocess_all(program, candidates)


class SplitPartitioner(Partitioner):
    """relu/sigmoid runs to the toy backend, every other op to gpudelegate."""

    def partition(self, graph: ExportGraph):
        toy = contiguous_runs(graph, lambda n: n.op in TOY)
        gpu = contiguous_runs(graph, lambda n: n.op not in TOY)
        return ([Partition("toy", r) for r in toy] + [Partition("gpudelegate", r, {"weights_dtype": "float32"})
                                                     for r in gpu])


def _graphs():
    torch.manual_seed(0)
    gated = Gated().eval()
    xa, xb = rnd(3, 13), rnd(5, 13)
    return gated, {"gated": lower(export_method(gated, (xa,)), "gated"),
                   "score": lower(export_method(Score(gated), (xb,)), "score")}, {"gated": xa, "score": xb}


# ------------------------------------------------------------------------------ to_backend

def test_preprocess_all_once_per_backend_with_every_methods_partitions():
    gated, graphs, inputs = _graphs()
    toy, gpu = ToyBackend(), RecordingGpuBackend()
    part = SplitPartitioner()
    expected = {name: part.partition(g) for name, g in graphs.items()}
    lp = to_backend(graphs, {name: part for name in graphs}, backends={"toy": toy, "gpudelegate": gpu})

    # exactly one call per backend, holding the partitions of both methods
    assert len(toy.calls) == 1 and len(gpu.calls) == 1
    for backend, calls in (("toy", toy.calls), ("gpudelegate", gpu.calls)):
        got = calls[0]
        assert set(got) == {"gated", "score"}, backend
        for name, cands in got.items():
            want = [p.nodes for p in expected[name] if p.backend_id == backend]
            assert [c.partition.nodes for c in cands] == want
            assert [c.index for c in cands] == [i for i, p in enumerate(lp.partitions[name]) if p.backend_id == backend]
            for c in cands:
                assert c.method == name and c.partition.backend_id == backend
                assert all((n.op in TOY) == (backend == "toy") for n in c.graph.nodes)
    assert sorted(lp.preprocess_calls) == ["gpudelegate", "toy"]

    # each partition became one delegate call into a payload of its backend
    prog = lp.program
    for name, parts in lp.partitions.items():
        calls = [n for n in prog.methods[name].nodes if n.op == DELEGATE_OP]
        assert len(calls) == len(parts)
        assert sorted(prog.payloads[n.attrs["payload"]].backend for n in calls) == sorted(p.backend_id for p in parts)
    # gated: linear | relu | linear | sigmoid | mul -> 5 calls alternating backends
    assert [prog.payloads[n.attrs["payload"]].backend for n in prog.methods["gated"].nodes] == \
        ["gpudelegate", "toy", "gpudelegate", "toy", "gpudelegate"]

    # fc1's weight is read by both methods (and both backends' payloads) and stored once
    w1 = gated.fc1.weight.detach().numpy()
    assert sum(c.shape == w1.shape for c in prog.constants) == 1

    for name, x in inputs.items():
        module = gated if name == "gated" else Score(gated)
        assert_close(run_reference(prog, [x.numpy()], name), torch_float64(module, [x]), FP32_TOL, name)


def test_partitions_are_checked():
    _, graphs, _ = _graphs()
    g = {"gated": graphs["gated"]}
    n = len(g["gated"].nodes)  # linear relu linear sigmoid mul

    class Fixed(Partitioner):
        def __init__(self, parts):
            self.parts = parts

        def partition(self, graph):
            return self.parts

    with pytest.raises(ExportError, match=r"node 1 \(relu\) is in partitions 0 and 1"):
        to_backend(g, {"gated": Fixed([Partition("gpudelegate", (0, 1)), Partition("gpudelegate", (1, 2))])})
    with pytest.raises(ExportError, match=f"names node {n}, outside 0..{n - 1}"):
        to_backend(g, {"gated": Fixed([Partition("gpudelegate", (0, n))])})
    # {linear, linear} without the relu between them: a path leaves the partition and comes back
    with pytest.raises(ExportError, match=r"partition 0 \(gpudelegate\) is not convex: node 2 \(linear\) depends on "
                                          r"node 1 \(relu\)"):
        to_backend(g, {"gated": Fixed([Partition("gpudelegate", (0, 2))])})
    with pytest.raises(ExportError, match="no backend 'nope' is registered"):
        to_backend(g, {"gated": Fixed([Partition("nope", (0,))])})
    with pytest.raises(ExportError, match=r"partitioners given for methods \['other'\]"):
        to_backend(g, {"other": GpuDelegatePartitioner()})

    class Lazy(ToyBackend):
        def preprocess_all(self, program, candidates):
            return {m: [] for m in candidates}

    with pytest.raises(ExportError, match="preprocess_all returned 0 payloads for method 'gated', which has 2"):
        to_backend(g, {"gated": SplitPartitioner()}, backends={"toy": Lazy()})


def test_host_fallback_for_ops_the_partitioner_leaves():
    gated, graphs, inputs = _graphs()
    x = inputs["gated"]
    lp = to_backend({"gated": graphs["gated"]}, {"gated": GpuDelegatePartitioner(exclude_ops=["relu"])})
    assert [n.op for n in lp.program.methods["gated"].nodes] == [DELEGATE_OP, "relu", DELEGATE_OP]
    assert lp.host_ops("gated") == ["relu"]
    assert_close(run_reference(lp.program, [x.numpy()], "gated"), torch_float64(gated, [x]), FP32_TOL, "host relu")

    # nothing partitioned (and an ExportedProgram given as it is): the whole method runs on the
    # host, its constants read from the program
    lp = to_backend({"gated": export_method(gated, (x,))}, {"gated": NoPartitioner()})
    assert DELEGATE_OP not in [n.op for n in lp.program.methods["gated"].nodes] and not lp.program.payloads
    assert_close(run_reference(lp.program, [x.numpy()], "gated"), torch_float64(gated, [x]), FP32_TOL, "all host")


def test_a_weight_read_by_two_partitions_of_one_method_is_stored_once():
    lin = nn.Linear(11, 11).eval()
    m = nn.Sequential(lin, nn.GELU(), lin).eval()  # the same weight on both sides of a host op
    x = rnd(3, 11)
    lp = export_program(m, (x,), partitioner=GpuDelegatePartitioner(exclude_ops=["gelu"]), return_lowered=True)
    prog = lp.program
    assert len(prog.payloads) == 2 and len(prog.constants) == 2  # weight + bias, once each
    for pl in prog.payloads:
        assert sorted(pl.values[e.src].constant for e in pl.prepack) == [0, 1]
    assert_close(run_reference(prog, [x.numpy()]), torch_float64(m, [x]), FP32_TOL, "shared weight")


# ------------------------------------------------------------------------------ the gpudelegate backend

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(509, 1021)  # 2.08 MB of weights

    def forward(self, x):
        return torch.relu(self.proj(x))

    def score(self, x):
        return self.proj(x).sum(-1)


def test_two_methods_share_their_weights_in_the_file(tmp_path):
    torch.manual_seed(1)
    enc = Encoder().eval()
    xa, xb = rnd(2, 509), rnd(7, 509)
    path = tmp_path / "two.gdp"
    prog = export_program({"encode": (enc, (xa,)), "score": (enc.score, (xb,))}, path=path, progress=False)
    weight_bytes = sum(p.numel() * 4 for p in enc.parameters())
    size = os.path.getsize(path)
    assert weight_bytes <= size <= 1.01 * weight_bytes, f"file {size} B for {weight_bytes} B of weights"
    assert len(prog.constants) == 2
    # both payloads prepack the same two program constants
    assert [sorted(pl.values[e.src].constant for e in pl.prepack) for pl in prog.payloads] == [[0, 1], [0, 1]]
    loaded = gpudelegate.load(path)
    assert_close(run_reference(loaded, [xa.numpy()], "encode"), torch_float64(enc, [xa]), FP32_TOL, "encode")
    with torch.no_grad():
        ref_b = [copy.deepcopy(enc).double().score(xb.double()).numpy()]
    assert_close(run_reference(loaded, [xb.numpy()], "score"), ref_b, FP32_TOL, "score")


class EmbedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(97, 16)
        self.fc1 = nn.Linear(16, 37)
        self.fc2 = nn.Linear(37, 5)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


def test_fp16_weight_storage_prepack_and_offload_schedule():
    torch.manual_seed(2)
    m = EmbedMLP().eval()
    ids = torch.randint(0, 97, (3, 7))
    prog = export_program(m, (ids,), weights_dtype="float16")
    assert all(c.dtype == "float32" for c in prog.constants)  # the file keeps float32; the device packs
    (pl,) = prog.payloads
    layouts = {pl.values[e.src].name: (e.layout, pl.values[e.dst].dtype) for e in pl.prepack}
    assert layouts == {"emb.weight": ("fp16", "float16"), "fc1.weight": ("fp16", "float16"),
                       "fc2.weight": ("fp16", "float16"), "fc1.bias": ("identity", "float32"),
                       "fc2.bias": ("identity", "float32")}
    # embedding of float16 rows is widened back to the float32 the graph was typed with
    assert [n.op for n in pl.nodes] == ["embedding", "cast", "linear", "relu", "linear"]
    dsts = {e.dst for e in pl.prepack}
    assert pl.offload.reads == [[a for a in n.args if a in dsts] for n in pl.nodes]
    assert [len(r) for r in pl.offload.reads] == [1, 0, 2, 0, 2]
    got = run_reference(prog, [ids.numpy()])
    assert_close(got, torch_float64(m, [ids]), FP16_TOL, "fp16 weights")

    # fp16_at="export": the file itself holds float16 weights (half the download), copied as is
    small = export_program(m, (ids,), weights_dtype="float16", fp16_at="export")
    (sp,) = small.payloads
    assert {sp.values[e.src].name: (e.layout, sp.values[e.src].dtype) for e in sp.prepack} == {
        "emb.weight": ("identity", "float16"), "fc1.weight": ("identity", "float16"),
        "fc2.weight": ("identity", "float16"), "fc1.bias": ("identity", "float32"),
        "fc2.bias": ("identity", "float32")}
    weights = ("emb.weight", "fc1.weight", "fc2.weight")
    assert small.constant_bytes_total == prog.constant_bytes_total - sum(
        sp.values[e.src].nbytes for e in sp.prepack if sp.values[e.src].name in weights)
    np.testing.assert_array_equal(run_reference(small, [ids.numpy()])[0], got[0])  # same values on device
    with pytest.raises(ExportError, match="fp16_at='later'"):
        export_program(m, (ids,), weights_dtype="float16", fp16_at="later")

    fp32 = export_program(m, (ids,))
    assert {e.layout for e in fp32.payloads[0].prepack} == {"identity"}
    assert fp32.payloads[0].nodes[0].op == "embedding" and len(fp32.payloads[0].nodes) == 4


# ------------------------------------------------------------------------------ writer and CLI

def test_save_program_reports_progress_and_never_leaves_a_partial_file(tmp_path):
    prog = export_program(Encoder(), (rnd(2, 509),))
    seen = []
    path = tmp_path / "p.gdp"
    size = save_program(prog, path, progress=lambda done, total: seen.append((done, total)))
    assert size == os.path.getsize(path) and not (tmp_path / "p.gdp.partial").exists()
    total = prog.constant_bytes_total
    assert seen and seen[-1] == (total, total) and all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    assert gpudelegate.load(path).constant_bytes_total == total

    def boom(done, total):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        save_program(prog, tmp_path / "q.gdp", progress=boom)
    assert sorted(os.listdir(tmp_path)) == ["p.gdp"]


def test_progress_bar_on_request(tmp_path, capsys):
    prog = export_program(Encoder(), (rnd(2, 509),))
    save_program(prog, tmp_path / "bar.gdp", progress=True)
    assert "writing bar.gdp" in capsys.readouterr().err
    save_program(prog, tmp_path / "quiet.gdp", progress=False)
    assert capsys.readouterr().err == ""


SCRIPT = """
import torch
def build_torch_model():
    return torch.nn.Sequential(torch.nn.Linear(17, 13), torch.nn.GELU())
def example_inputs():
    return (torch.randn(3, 17),)
"""


def test_cli_exports_a_model_script(tmp_path, capsys):
    from gpudelegate.export.cli import main

    script = tmp_path / "model.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out" / "m.gdp"
    assert main([str(script), str(out), "--weights-dtype", "float16", "--no-progress"]) == 0
    assert "1 delegate call" in capsys.readouterr().out
    prog = gpudelegate.load(out)
    assert prog.metadata["weights_dtype"] == "float16"
    assert sorted(e.layout for e in prog.payloads[0].prepack) == ["fp16", "identity"]  # weight fp16, bias not

    bad = tmp_path / "empty.py"
    bad.write_text("x = 1\n")
    assert main([str(bad), str(tmp_path / "e.gdp")]) == 1
    assert "defines neither export(path" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.py"), str(tmp_path / "e.gdp")]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(out)])  # a script but no output
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--model" in capsys.readouterr().out
