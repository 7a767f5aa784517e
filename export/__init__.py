"""gpudelegate.export: the ahead-of-time half (needs torch).

PyTorch model -> ``torch.export`` -> our op set (:mod:`.frontend`, :mod:`.aten_table`) ->
partitions (:mod:`.partitioner`) -> ``to_backend`` with one ``preprocess_all`` per backend
(:mod:`.to_backend`, :mod:`.backend`) -> one program file (:mod:`.writer`).

    from gpudelegate.export import export_program
    export_program(model, (x,), path="model.gdp", weights_dtype="float16")

Without torch (a wheel installed without the ``export`` extra) the package still imports, so
that ``gpudelegate export --help`` (:mod:`.cli`) works; its names then raise an ImportError that
says which extra brings torch.
"""

__all__ = ["BackendDetails", "DelegateCandidate", "GpuDelegateBackend", "register_backend", "ExportGraph", "GNode",
           "GValue", "decomposition_table", "export_method", "lower", "GpuDelegatePartitioner", "NoPartitioner",
           "Partition", "Partitioner", "LoweredProgram", "to_backend", "export_program", "save_program",
           "verify_program"]

try:
    import torch  # noqa: F401
except ImportError as _e:
    _NO_TORCH = _e

    def __getattr__(name):
        if name in __all__:
            raise ImportError(f"gpudelegate.export.{name} needs torch ({_NO_TORCH}): "
                              f"pip install 'gpudelegate[export]'", name="torch")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
else:
    from . import aten_table  # noqa: F401  (defines torch.ops.gpudelegate.kv_update / rope)
    from .backend import BackendDetails, DelegateCandidate, GpuDelegateBackend, register_backend
    from .frontend import ExportGraph, GNode, GValue, decomposition_table, export_method, lower
    from .partitioner import GpuDelegatePartitioner, NoPartitioner, Partition, Partitioner
    from .to_backend import LoweredProgram, to_backend
    from .writer import export_program, save_program, verify_program
