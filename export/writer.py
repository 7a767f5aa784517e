"""``export_program``: PyTorch model(s) -> one program (optionally written to disk with a progress bar).

    prog = export_program(model, (x,), path="model.gdp")                       # one method, "forward"
    prog = export_program({"prefill": (Prefill(m), ins_p), "decode": (Decode(m), ins_d)}, path=...)

Every method is exported with ``torch.export``, lowered by the frontend, partitioned (by default
everything the gpudelegate backend runs) and handed to ``to_backend``, which calls the backend's
``preprocess_all`` once for all methods: the methods share one copy of their weights.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch

from gpudelegate.errors import ExportError, GpuDelegateError
from gpudelegate.program import Program, align_up, program_document

from .frontend import ExportGraph, export_method, lower
from .partitioner import GpuDelegatePartitioner, Partitioner, check_packed_weights
from .to_backend import LoweredProgram, to_backend


# ------------------------------------------------------------------------------ progress

class ProgressBar:
    """A tqdm bar for ``Program.save``'s ``progress(done, total)`` callback. ``enabled``: True
    always shows it, None shows it only when stderr is a terminal, False never."""

    def __init__(self, total: int, desc: str, enabled: Optional[bool] = None):
        show = enabled if enabled is not None else sys.stderr.isatty()
        self.bar = None
        if show and total > 0:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, leave=False)

    def __call__(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def save_program(program: Program, path, progress: Union[None, bool, Callable[[int, int], None]] = None) -> int:
    """Write ``program`` to ``path`` (``Program.save`` writes a temporary file and renames it, so a
    failed write never leaves a truncated program behind, and a loaded file is never overwritten
    in place); returns the file size. ``progress``: a ``(done, total)`` callback, or
    True/None/False for a tqdm bar (always / when stderr is a terminal / never)."""
    path = os.fspath(path)
    if callable(progress):
        return program.save(path, progress=progress)
    with ProgressBar(program.constant_bytes_total, f"writing {os.path.basename(path)}", progress) as bar:
        return program.save(path, progress=bar)


class _Phases:
    """One stderr line per export phase (torch.export of each method, lowering, partitioning,
    checks), shown when the write bar would be: a large model spends most of its export time
    before the first byte is written, and a silent terminal looks hung."""

    def __init__(self, progress):
        self.show = progress is True or (progress is None and sys.stderr.isatty())
        self.t0 = time.perf_counter()

    def __call__(self, what: str) -> None:
        if self.show:
            print(f"export [{time.perf_counter() - self.t0:5.1f}s] {what}", file=sys.stderr, flush=True)


def _training_modes(specs: Dict[str, Any]) -> List[tuple]:
    """(module, training) of every submodule of the modules being exported: export switches them
    to eval mode (``export_method``), and the caller's model must come back as it was given."""
    modes = []
    for spec in specs.values():
        if isinstance(spec, (tuple, list)) and len(spec) == 2:
            m = spec[0]
            m = m if isinstance(m, torch.nn.Module) else getattr(m, "__self__", None)
            if isinstance(m, torch.nn.Module):
                modes.extend((sub, sub.training) for sub in m.modules())
    return modes


def verify_program(program: Program) -> None:
    """Run the loader's document checks on a program built in memory (the same checks a reader
    applies), so an export that would not load fails here, naming the path inside the document."""
    from gpudelegate.validate import program_from_document

    off = 0
    for c in program.constants:  # the writer's layout: 64-aligned, in order
        c.offset = off
        off = align_up(off + c.nbytes)
    program_from_document(program_document(program), data_size=off, header_version=program.version)


# ------------------------------------------------------------------------------ methods

class _BoundMethod(torch.nn.Module):
    """Exports ``module.<name>`` as a method (torch.export exports ``forward`` of a Module)."""

    def __init__(self, module: torch.nn.Module, name: str):
        super().__init__()
        self.module = module
        self.name = name

    def forward(self, *args):
        return getattr(self.module, self.name)(*args)


def _as_module(fn, where: str) -> torch.nn.Module:
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return _BoundMethod(owner, fn.__name__)
    raise ExportError(f"{where}: expected an nn.Module or a bound method of one, got {type(fn).__name__}")


def _method_graph(name: str, spec: Any) -> ExportGraph:
    # Graphs lowered here know which constants are parameters (what weights_dtype may quantize);
    # a caller's own ExportGraph says so through GValue.parameter.
    if isinstance(spec, ExportGraph):
        return spec
    if isinstance(spec, torch.export.ExportedProgram):
        return lower(spec, name=name)
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        module, inputs = spec
        ep = export_method(_as_module(module, f"methods[{name!r}]"), inputs)
        return lower(ep, name=name)
    raise ExportError(f"methods[{name!r}]: expected (module, example_inputs), an ExportedProgram or an "
                      f"ExportGraph, got {type(spec).__name__}")


def _methods(model_or_methods: Any, example_inputs: Optional[Sequence]) -> Dict[str, Any]:
    if isinstance(model_or_methods, Mapping):
        if example_inputs is not None:
            raise ExportError("example_inputs is given per method when methods are a dict: {name: (module, inputs)}")
        if not model_or_methods:
            raise ExportError("no methods to export")
        return dict(model_or_methods)
    if isinstance(model_or_methods, (torch.export.ExportedProgram, ExportGraph)):
        return {"forward": model_or_methods}
    if example_inputs is None:
        raise ExportError("example_inputs are needed to export a module (a tuple of tensors)")
    return {"forward": (model_or_methods, example_inputs)}


def _per_method(x, names: List[str], what: str) -> Dict[str, Any]:
    if x is None:
        return {}
    if isinstance(x, Mapping):
        unknown = sorted(set(x) - set(names))
        if unknown:
            raise ExportError(f"{what} names methods {unknown} that are not exported ({names})")
        return dict(x)
    if len(names) != 1:
        raise ExportError(f"{what} for several methods must be a dict {{method: ...}}")
    return {names[0]: x}


def _rename(g: ExportGraph, ids: List[int], names: Optional[Sequence[str]], what: str) -> None:
    if names is None:
        return
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise ExportError(f"{g.name}: {what} names must be a list of strings, not {type(names).__name__}")
    names = list(names)
    if not all(isinstance(n, str) and n for n in names):
        raise ExportError(f"{g.name}: {what} names must be non-empty strings, got {names!r}")
    if len(names) != len(ids):
        raise ExportError(f"{g.name}: {len(names)} {what} names given for {len(ids)} {what}s")
    for vid, n in zip(ids, names):
        g.values[vid].name = str(n)


# ------------------------------------------------------------------------------ entry point

def export_program(model_or_methods: Any, example_inputs: Optional[Sequence] = None, *, path=None,
                   weights_dtype: str = "float32", fp16_at: str = "load",
                   progress: Union[None, bool, Callable[[int, int], None]] = None,
                   partitioner: Union[None, Partitioner, Mapping[str, Partitioner]] = None,
                   metadata: Optional[dict] = None, input_names=None, output_names=None,
                   return_lowered: bool = False, packed_weights: Optional[Mapping[str, tuple]] = None,
                   ) -> Union[Program, LoweredProgram]:
    """Export a model (method ``forward``) or ``{method: (module, example_inputs)}`` into one program.

    ``weights_dtype="float16"`` stores weights as float16 on the device: packed at load from the
    float32 constants in the file (``fp16_at="load"``), or converted at export so the file itself
    holds float16 and is half the size (``fp16_at="export"``, what a browser download wants).
    ``weights_dtype="q4_0"``, ``"q4_1"`` or ``"q8_0"`` quantizes the parameters read as linear
    weights and embedding tables (last dim a multiple of 32, at least 4096 values) into GGUF
    blocks at export; everything else stays float32. ``packed_weights`` maps
    ``gpudelegate.native.quant.weight_key(w)`` of a float32 weight to ``(dtype, blocks)`` made
    elsewhere (a GGUF file's own): those blocks are stored for that weight, after checking that
    gguf dequantizes them to exactly ``w`` (an ExportError names the weight otherwise).
    ``partitioner`` defaults to :class:`GpuDelegatePartitioner` (every op
    of the set goes to the device). ``input_names``/``output_names`` name the method signature (a
    list, or ``{method: list}``). With ``path`` the program is written there (a tqdm bar per
    ``progress``: True always, None when stderr is a terminal, False never, or a callback)."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ExportError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    if weights_dtype == "gguf":
        raise ExportError("weights_dtype='gguf' keeps a GGUF file's own block types, and export_program reads no "
                          "GGUF: pass its blocks as packed_weights, or use an exporter that reads one "
                          "(gpudelegate.export.models.smollm2.export)")
    if packed_weights is not None and partitioner is not None:
        raise ExportError("packed_weights goes to the default partitioner; with your own partitioner, give it "
                          "GpuDelegatePartitioner(packed_weights=...)")
    check_packed_weights(packed_weights)  # before torch.export, which takes most of an export's time
    specs = _methods(model_or_methods, example_inputs)
    modes = _training_modes(specs)
    try:
        return _export_program(specs, path=path, weights_dtype=weights_dtype, fp16_at=fp16_at, progress=progress,
                               partitioner=partitioner, metadata=metadata, input_names=input_names,
                               output_names=output_names, return_lowered=return_lowered,
                               packed_weights=packed_weights)
    finally:
        for sub, training in modes:  # eval() changed them; restore the caller's modes
            sub.training = training


def _export_program(specs, *, path, weights_dtype, fp16_at, progress, partitioner, metadata, input_names,
                    output_names, return_lowered, packed_weights):
    phase = _Phases(progress)
    names = list(specs)
    in_names = _per_method(input_names, names, "input_names")
    out_names = _per_method(output_names, names, "output_names")
    graphs: Dict[str, ExportGraph] = {}
    for name, spec in specs.items():
        phase(f"torch.export + lowering of {name!r}")
        g = _method_graph(name, spec)
        g.name = name
        _rename(g, g.inputs, in_names.get(name), "input")
        _rename(g, g.outputs, out_names.get(name), "output")
        graphs[name] = g

    if partitioner is None:
        # one partitioner for all methods: they share packed_weights, checked once
        shared = GpuDelegatePartitioner(weights_dtype=weights_dtype, fp16_at=fp16_at, packed_weights=packed_weights)
        partitioners = {n: shared for n in names}
    elif isinstance(partitioner, Partitioner):
        partitioners = {n: partitioner for n in names}
    else:
        partitioners = dict(partitioner)
    phase("partitioning and preprocessing for the backends")
    lowered = to_backend(graphs, partitioners)
    program = lowered.program
    program.metadata.update({"producer": "gpudelegate.export", "torch": torch.__version__,
                             "weights_dtype": weights_dtype})
    program.metadata.update(metadata or {})
    phase("checking the program")
    try:
        verify_program(program)
    except GpuDelegateError as e:
        raise ExportError(f"the exported program does not pass the loader's checks (an export bug): {e}") from e
    if path is not None:
        phase(f"writing {os.fspath(path)}")
        try:
            save_program(program, path, progress=progress)
        except OSError as e:
            raise ExportError(f"cannot write {os.fspath(path)!r}: {e.strerror or e}") from None
    return lowered if return_lowered else program
