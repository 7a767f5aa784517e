"""The public entry points of program-document validation (the checks: :mod:`.document`).

:func:`program_from_document` turns a decoded document into a
:class:`~gpudelegate.program.Program`, checking everything (every failure a
:class:`~gpudelegate.errors.PayloadError` naming the path inside the document, see
:mod:`.document` for the list); :func:`verify_constant_hashes` then checks the data segment itself
(keys and zero padding). ``gpudelegate.loads`` runs both; the browser loader and the export
writer call them directly.

The checks live in :mod:`.document` and the Program is built in :mod:`.program`, which imports
them: this module only re-exports, so nothing imports in a circle.
"""

from __future__ import annotations

from .document import (MAX_ATTR_DEPTH, MAX_METADATA_DEPTH, MAX_RANK, MAX_TENSOR_BYTES, PREPACK_LAYOUTS,
                       program_fields, verify_constant_hashes)
from .program import program_from_document

__all__ = ["program_from_document", "program_fields", "verify_constant_hashes", "MAX_RANK", "MAX_TENSOR_BYTES",
           "MAX_ATTR_DEPTH", "MAX_METADATA_DEPTH", "PREPACK_LAYOUTS"]
