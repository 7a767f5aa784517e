"""What the CUDA tests share: CuPy where a CUDA device answers (``cp``; ``None`` elsewhere, with
the reason in ``REASON`` for the skip message). Imported as ``cuda_env`` by the tests of this
folder (pytest puts it on ``sys.path``); the ``env`` fixture is in this folder's conftest.py."""

from __future__ import annotations

from gpudelegate.errors import DeviceError
from gpudelegate.native.cuda_executor import import_cupy


def _probe():
    try:
        return import_cupy(), ""
    except DeviceError as e:
        return None, str(e)


cp, REASON = _probe()
