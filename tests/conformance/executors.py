"""The executors the conformance suite holds to the reference kernels.

An executor joins by appending an :class:`ExecutorSpec` to ``EXECUTORS`` (here, or from its own
module imported below). ``available()`` returns ``(ok, reason)``; an unavailable executor's cases
are skipped with that reason, which ``pytest -rs`` prints, so "no GPU here" is never silent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, List, Tuple

from gpudelegate.environment import Environment
from gpudelegate.errors import GpuDelegateError


@dataclass(frozen=True)
class ExecutorSpec:
    name: str  # test id
    device_kind: str  # Environment device kind (env.session(..., device=device_kind))
    available: Callable[[], Tuple[bool, str]]
    session_options: dict = field(default_factory=dict)  # extra env.session keyword arguments
    marks: Tuple[str, ...] = ()  # pytest markers (e.g. "wgpu", "gpu") for selecting runs


def probe_device(kind: str) -> Callable[[], Tuple[bool, str]]:
    """``available`` for a device kind: start its context once in a scratch Environment."""

    @functools.lru_cache(maxsize=None)
    def available() -> Tuple[bool, str]:
        env = Environment()
        try:
            env.context(kind)
            return True, ""
        except GpuDelegateError as e:  # DeviceError: module missing, no adapter, no CUDA
            return False, f"device {kind!r} unavailable: {e}"
        finally:
            env.close()

    return available


EXECUTORS: List[ExecutorSpec] = [
    ExecutorSpec("reference", "reference", probe_device("reference")),
    ExecutorSpec("wgpu", "wgpu", probe_device("wgpu"), marks=("wgpu",)),
    ExecutorSpec("cuda", "cuda", probe_device("cuda"), marks=("gpu",)),
]
