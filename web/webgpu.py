"""WebGPU from Python in Pyodide: the adapter/device (one per page, shared by every session) and
thin helpers over ``js`` with the WebGPU spec's names kept as they are.

Device creation is asynchronous in the browser. ``await init()`` creates it; the synchronous
``Environment.context("webgpu")`` path then reuses it, or creates it itself through JSPI
(``pyodide.ffi.run_sync``) when the caller runs inside ``runPythonAsync``/a promising call.
"""

from __future__ import annotations

from typing import Any, Optional

from gpudelegate.errors import DeviceError

NO_WEBGPU = ("WebGPU is not available here: navigator.gpu is undefined. Use a browser with WebGPU "
             "(Chrome/Edge 113+, Safari 26+, Firefox 141+ on Windows); a headless Chromium needs "
             "--enable-unsafe-webgpu; the page must be served from https:// or http://localhost")
NO_ADAPTER = ("WebGPU is present but requestAdapter() returned no adapter (GPU blocklisted or "
              "disabled; a headless Chromium needs --enable-unsafe-webgpu)")


def js():
    import js as _js  # only importable inside Pyodide; imported lazily so the module is testable
    return _js


def to_js(x: Any):
    """Python dicts/lists -> plain JS objects/arrays (WebGPU descriptors)."""
    from pyodide.ffi import to_js as _to_js
    return _to_js(x, dict_converter=js().Object.fromEntries)


def is_nullish(x) -> bool:
    """JS null/undefined as Pyodide hands them over (None, or a JsNull object in Pyodide 314)."""
    return x is None or type(x).__name__ in ("JsNull", "JsUndefined") or str(x) in ("null", "undefined") \
        and type(x).__module__.startswith("pyodide")


def can_run_sync() -> bool:
    try:
        from pyodide.ffi import can_run_sync as _can
    except ImportError:
        return False
    return bool(_can())


def run_sync(awaitable):
    """Block on a JS promise / Python awaitable through JSPI; a clear DeviceError where the
    caller's stack cannot be suspended (plain runPython, or a browser without JSPI)."""
    if not can_run_sync():
        raise DeviceError("this call needs to wait for the GPU, which a synchronous call can only do "
                          "through JSPI (run it inside pyodide.runPythonAsync, in a browser with "
                          "JSPI), or use the async API: await session.run_async(...)")
    from pyodide.ffi import run_sync as _run_sync
    return _run_sync(awaitable)


class GPUState:
    """The page's adapter and device, and why it was lost (if it was)."""

    def __init__(self, adapter, device, features):
        self.adapter = adapter
        self.device = device
        self.queue = device.queue
        self.features = features
        self.lost_reason: Optional[str] = None
        info = getattr(adapter, "info", None)
        self.info = {
            "vendor": str(getattr(info, "vendor", "") or ""),
            "architecture": str(getattr(info, "architecture", "") or ""),
            "device": str(getattr(info, "device", "") or ""),
            "description": str(getattr(info, "description", "") or ""),
            "is_fallback_adapter": bool(getattr(info, "isFallbackAdapter", False)),
        }

    def check(self, where: str = "") -> None:
        if self.lost_reason is not None:
            raise DeviceError(f"the WebGPU device was lost{' ' + where if where else ''}: {self.lost_reason}; "
                              f"reload the page (or create a new Environment) to start again")


_STATE: Optional[GPUState] = None


def state() -> Optional[GPUState]:
    return _STATE if _STATE is not None and _STATE.lost_reason is None else None


# The limits we ask for: the adapter's own, so big models get big bindings (the defaults are
# 128 MiB per binding and 256 MiB per buffer).
_WANTED_LIMITS = ("maxBufferSize", "maxStorageBufferBindingSize", "maxStorageBuffersPerShaderStage",
                  "maxComputeWorkgroupStorageSize", "maxComputeInvocationsPerWorkgroup",
                  "maxComputeWorkgroupSizeX", "maxComputeWorkgroupSizeY", "maxComputeWorkgroupsPerDimension")
_WANTED_FEATURES = ("shader-f16", "timestamp-query", "subgroups")


async def init(power_preference: str = "high-performance") -> GPUState:
    """Create (once) the page's WebGPU adapter and device. Raises DeviceError with a message that
    says what to do when WebGPU or an adapter is missing."""
    global _STATE
    if state() is not None:
        return _STATE
    J = js()
    gpu = getattr(J.navigator, "gpu", None)
    if is_nullish(gpu):
        raise DeviceError(NO_WEBGPU)
    adapter = await gpu.requestAdapter(to_js({"powerPreference": power_preference}))
    if is_nullish(adapter):
        raise DeviceError(NO_ADAPTER)
    features = [f for f in _WANTED_FEATURES if adapter.features.has(f)]
    limits = {}
    for name in _WANTED_LIMITS:
        v = getattr(adapter.limits, name, None)
        if v is not None:
            limits[name] = int(v)
    device = await adapter.requestDevice(to_js({"requiredFeatures": features, "requiredLimits": limits}))
    st = GPUState(adapter, device, tuple(features))

    def on_lost(info):
        st.lost_reason = f"{info.reason}: {info.message}" if getattr(info, "message", "") else str(info.reason)

    from pyodide.ffi import create_once_callable
    device.lost.then(create_once_callable(on_lost))
    _STATE = st
    return st


def get_state() -> GPUState:
    """The initialized state, creating it through JSPI if needed (see module doc)."""
    st = state()
    if st is not None:
        return st
    if _STATE is not None and _STATE.lost_reason is not None:
        _STATE.check()
    return run_sync(init())
