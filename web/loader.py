"""Programs whose data segment stays in JavaScript.

In the browser the program file is fetched into a JS ``ArrayBuffer`` (with progress, cached in
Cache Storage). Only the header and the msgpack document are copied into Python; the constants are
written to GPU buffers straight from typed-array views over the fetched bytes, so a 300 MB model
does not also occupy 300 MB of the WebAssembly heap.
"""

from __future__ import annotations

import msgpack

from gpudelegate import program as _prog
from gpudelegate.errors import PayloadError
from gpudelegate.program import Program


def head_size(header: bytes) -> int:
    """Bytes the Python side needs (header + document + padding) given the file's first 64 bytes:
    the data segment offset. Raises PayloadError for a short or foreign header."""
    mv = memoryview(header).cast("B")
    if mv.nbytes < _prog.HEADER_SIZE:
        raise PayloadError("header", f"file is {mv.nbytes} bytes, shorter than the {_prog.HEADER_SIZE}-byte header (truncated?)")
    fields = _prog._HEADER.unpack_from(mv, 0)
    magic, data_off = fields[0], fields[5]
    if magic != _prog.MAGIC:
        raise PayloadError("header.magic", f"{bytes(magic)!r} is not a gpudelegate program (expected {_prog.MAGIC!r})")
    return data_off


def loads_head(head, total_size: int) -> Program:
    """Decode and validate a program from its first ``data_offset`` bytes, knowing the file is
    ``total_size`` bytes long. The returned program has no ``data``: executors read constants
    from the JS-side data segment (``WebGPUExecutor(..., data=...)``).

    The header checks are the core's own (``program.read_header``): it is given the head with the
    data-segment size field set to 0, so it checks magic, version, layout and padding exactly as
    for a whole file; the data segment's size is then checked against ``total_size`` here."""
    from gpudelegate.validate import program_from_document

    mv = memoryview(head).cast("B")
    data_off = head_size(mv)
    if mv.nbytes < data_off:
        raise PayloadError("header.data_offset", f"{data_off} but only {mv.nbytes} head bytes were given")
    fields = list(_prog._HEADER.unpack_from(mv, 0))
    data_size = fields[6]
    patched = bytearray(mv[:data_off])
    fields[6] = 0
    _prog._HEADER.pack_into(patched, 0, *fields)
    version, doc_off, doc_size, data_off, _ = _prog.read_header(patched)
    if data_size % _prog.ALIGN:
        raise PayloadError("header.data_size", f"{data_size} is not a multiple of {_prog.ALIGN}")
    if data_off + data_size != total_size:
        raise PayloadError("header.data_size", f"data segment [{data_off}, {data_off + data_size}) does not end the "
                                               f"{total_size}-byte file (truncated or trailing bytes)")
    try:
        doc = msgpack.unpackb(mv[doc_off:doc_off + doc_size], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types for hostile bytes
        raise PayloadError("document", f"not a valid msgpack document ({type(e).__name__}: {str(e)[:200]})") from None
    return program_from_document(doc, data_size=data_size, header_version=version)


def key_salt(dtype: str, shape) -> bytes:
    """The suffix hashed after a constant's bytes to form its key (``program.constant_key``)."""
    return f"{dtype}{tuple(int(d) for d in shape)}".encode()


__all__ = ["head_size", "loads_head", "key_salt"]
