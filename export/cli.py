"""``gpudelegate export``: a model script (or a bundled model) -> a program file.

    gpudelegate export MODEL_SCRIPT OUT.gdp [--weights-dtype float16]
    gpudelegate export --model mnist OUT.gdp
    gpudelegate export --model smollm2 OUT.gdp --weights-dtype gguf   # the GGUF's own 4-bit blocks

A model script is a Python file that defines either ``export(path, weights_dtype=...)`` (it does
everything itself, as ``examples/mnist.py`` does), or ``build_torch_model()`` and
``example_inputs()`` (exported as the method ``forward``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from gpudelegate.errors import ExportError, GpuDelegateError

_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# name -> (script path or "module:function", what it is)
MODELS: Dict[str, tuple] = {
    "mnist": (str(_EXAMPLES / "mnist.py"), "MNIST CNN (digit-recognizer-py), 1x1x28x28"),
    "efficientnet": (str(_EXAMPLES / "efficientnet.py"), "EfficientNet-Lite0 ImageNet, 1x3x224x224"),
    "minilm": ("gpudelegate.export.models.minilm:export", "all-MiniLM-L6-v2 sentence embeddings"),
    "smollm2": ("gpudelegate.export.models.smollm2:export", "SmolLM2-135M-Instruct, prefill + decode"),
}
GGUF_MODELS = ("smollm2",)  # bundled models read from a GGUF: --weights-dtype gguf keeps its blocks

WEIGHT_DTYPES = ("float32", "float16", "q4_0", "q4_1", "q8_0", "gguf")


def _load_script(path: str):
    if not os.path.isfile(path):
        raise ExportError(f"model script {path!r} does not exist"
                          + (" (bundled examples are only in a source checkout)" if str(_EXAMPLES) in path else ""))
    name = "gpudelegate_model_" + Path(path).stem.replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(mod)
    return mod


def _exporter(target: str) -> Callable:
    """``export(path, weights_dtype=..., progress=...)`` of a script or a ``module:function``."""
    if ":" in target and not os.path.exists(target):
        mod_name, fn = target.split(":", 1)
        return getattr(importlib.import_module(mod_name), fn)
    mod = _load_script(target)
    if callable(getattr(mod, "export", None)):
        return mod.export
    if callable(getattr(mod, "build_torch_model", None)) and callable(getattr(mod, "example_inputs", None)):
        from .writer import export_program

        def export(path, weights_dtype="float32", progress=None):
            # weights_dtype="gguf" reaches export_program, whose ExportError says why it cannot be
            return export_program(mod.build_torch_model(), tuple(mod.example_inputs()), path=path,
                                  weights_dtype=weights_dtype, progress=progress)
        return export
    raise ExportError(f"{target}: defines neither export(path, weights_dtype=...) nor build_torch_model() "
                      f"and example_inputs()")


def available_models() -> Dict[str, tuple]:
    """The bundled models this installation can export: mnist and efficientnet are example
    scripts of a source checkout (``examples/``), which an installed wheel does not carry."""
    return {k: v for k, v in MODELS.items() if os.path.isfile(v[0]) or (":" in v[0] and not os.path.exists(v[0]))}


def _parser() -> argparse.ArgumentParser:
    avail = available_models()
    models = "\n".join(f"  {k:<13} {v[1]}" for k, v in avail.items())
    gone = sorted(set(MODELS) - set(avail))
    if gone:
        models += f"\n  (in a source checkout also: {', '.join(gone)}; their scripts are in examples/)"
    p = argparse.ArgumentParser(
        prog="gpudelegate export",
        usage=f"gpudelegate export [-h] [--weights-dtype {{{','.join(WEIGHT_DTYPES)}}}] [--no-progress] "
              "(MODEL_SCRIPT OUT | --model NAME OUT)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Export a PyTorch model (torch.export) to a gpudelegate program file.",
        epilog=f"bundled models (--model):\n{models}\n\n"
               "A MODEL_SCRIPT defines export(path, weights_dtype=...), or build_torch_model() and "
               "example_inputs().")
    p.add_argument("paths", nargs="+", metavar="[MODEL_SCRIPT] OUT", help="the model script (unless --model) and "
                                                                         "the program file to write")
    p.add_argument("--model", choices=sorted(avail), help="export a bundled model instead of a script")
    p.add_argument("--weights-dtype", choices=WEIGHT_DTYPES, default="float32",
                   help="storage of weights (compute stays float32): float16 halves their memory; q4_0, q4_1 "
                        "and q8_0 quantize linear weights and embedding tables into GGUF blocks at export "
                        "(~1/7, ~1/6, ~1/4 of float32); gguf keeps the blocks of the GGUF the model is read "
                        f"from (--model {', '.join(GGUF_MODELS)}, or a script whose export() reads a GGUF)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while writing")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    want = 1 if args.model else 2
    if len(args.paths) != want:
        p.error("give OUT with --model, or MODEL_SCRIPT OUT" if args.model else "give MODEL_SCRIPT and OUT "
                "(or --model NAME OUT)")
    out = args.paths[-1]
    target = MODELS[args.model][0] if args.model else args.paths[0]
    if args.weights_dtype == "gguf" and args.model and args.model not in GGUF_MODELS:
        # before the export: the check costs nothing, the export of a large model minutes
        print(f"gpudelegate export: --weights-dtype gguf keeps a GGUF file's own blocks, and {args.model} is not "
              f"read from a GGUF (those that are: {', '.join(GGUF_MODELS)}); use q4_0, q4_1 or q8_0 to quantize "
              f"its weights at export", file=sys.stderr)
        return 1
    try:
        exporter = _exporter(target)
        if os.path.dirname(out):
            os.makedirs(os.path.dirname(out), exist_ok=True)
        t0 = time.perf_counter()
        program = exporter(out, weights_dtype=args.weights_dtype, progress=False if args.no_progress else None)
        dt = time.perf_counter() - t0
    except GpuDelegateError as e:
        print(f"gpudelegate export: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        hint = " (pip install 'gpudelegate[export]' brings torch)" if getattr(e, "name", "") in ("torch", "tqdm", "numpy") else ""
        print(f"gpudelegate export: {e}{hint}", file=sys.stderr)
        return 1
    if not os.path.exists(out):
        print(f"gpudelegate export: {target} did not write {out}", file=sys.stderr)
        return 1
    _summary(program, out, dt)
    return 0


def _summary(program, out: str, seconds: float) -> None:
    from gpudelegate.inspect import constants_by_dtype, format_dtype_bytes
    from gpudelegate.program import DELEGATE_OP

    size = os.path.getsize(out)
    print(f"wrote {out}: {size / 1e6:.2f} MB in {seconds:.1f} s")
    if program is None or not hasattr(program, "methods"):
        return
    print(f"  constants: {len(program.constants)} ({program.constant_bytes_total / 1e6:.2f} MB, each stored once); "
          f"payloads: {len(program.payloads)}")
    print(f"  by type: {format_dtype_bytes(constants_by_dtype(program), size=lambda n: f'{n / 1e6:.2f} MB')}")
    for name, m in program.methods.items():
        host = sorted({n.op for n in m.nodes if n.op != DELEGATE_OP})
        calls = sum(n.op == DELEGATE_OP for n in m.nodes)
        sig = ", ".join(f"{m.values[v].name or v}:{m.values[v].dtype}{list(m.values[v].shape)}" for v in m.inputs)
        print(f"  {name}({sig}): {calls} delegate call(s)" + (f", host ops {host}" if host else ""))


if __name__ == "__main__":
    sys.exit(main())
