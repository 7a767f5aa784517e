"""The documented exception types of gpudelegate.

Every failure a user can cause (a bad file, a bad input, a budget too small, a missing device)
raises one of these, never a bare KeyError/IndexError/struct.error. Messages name what is wrong
and where (for program files, the path inside the document).
"""


class GpuDelegateError(Exception):
    """Base class of every error gpudelegate raises on purpose."""


class PayloadError(GpuDelegateError, ValueError):
    """A program file or delegate payload is malformed: corrupt or truncated bytes, wrong magic or
    version, wrong types, unknown ops, ids out of range, inconsistent shapes/dtypes, bad constants.
    The message starts with the path inside the document, e.g.
    ``methods.decode.ops[12].args[1]: value 999 out of range (0..311)``. Also a program file that
    cannot be read (missing, a directory, no permission), or one that changed on disk after
    ``load`` mapped it (the message names the file)."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.detail = message
        super().__init__(f"{path}: {message}" if path else message)


class UnsupportedOpError(PayloadError):
    """An op name that no kernel table knows (at load) or that a backend cannot run."""


class InputError(GpuDelegateError, ValueError):
    """Inputs given to ``Session.run`` do not match the method's signature (count, shape, dtype),
    hold an index out of range (embedding ids, a KV-cache position), or an argument of a public
    entry point has the wrong type (``load(None)``, ``run(method, array)`` instead of a list)."""


class BudgetError(GpuDelegateError, ValueError):
    """A weight budget below the offload floor (the message gives the floor and the largest
    weight; the runtime never falls back silently to a larger footprint), or planning options that
    cannot work: a negative budget or prefetch depth, a non-positive chunk size, unknown pinned
    weight names."""


class DeviceError(GpuDelegateError, RuntimeError):
    """No usable device (no WebGPU adapter, no CUDA), a tensor over the device's limits, or a
    closed session used: its ``run``, or a DeviceTensor it returned (its memory is freed)."""


class PlanError(GpuDelegateError, RuntimeError):
    """A plan violates an invariant the executors rely on (a location outside its memory object, a
    slot read before its load is waited for, a load placed after the dispatch that needs it, ...).
    Plans come from the planner, so this is a bug in it or a hand-edited plan, never a user input
    error: every executor raises this same type for it, before anything runs where it can."""


class ExportError(GpuDelegateError, ValueError):
    """A model cannot be exported (unsupported op not left to the host, bad example inputs, ...)."""
