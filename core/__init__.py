"""gpudelegate: one lowered model, three GPUs.

This package (the pure core) is Python + msgpack only, and runs unchanged in CPython and in
Pyodide. It decodes and validates program files, plans memory, prepack and weight offload, and
drives executors through sessions. Device executors live in ``gpudelegate.native`` (numpy
reference, wgpu, CUDA) and ``gpudelegate.web`` (Pyodide WebGPU).
"""

from .errors import (BudgetError, DeviceError, ExportError, GpuDelegateError, InputError,
                     PayloadError, PlanError, UnsupportedOpError)
from .program import Program, load, loads

__version__ = "0.1.0"

__all__ = ["BudgetError", "DeviceError", "ExportError", "GpuDelegateError", "InputError",
           "PayloadError", "PlanError", "UnsupportedOpError", "Program", "load", "loads", "__version__"]


def __getattr__(name):
    # Environment/Session are imported lazily so that `import gpudelegate` stays cheap.
    if name in ("Environment", "Session"):
        from . import environment, session
        return {"Environment": environment.Environment, "Session": session.Session}[name]
    raise AttributeError(name)
