"""Programs whose data segment stays in JavaScript, checked as their bytes arrive.

In the browser the program file is fetched into one JS ``Uint8Array`` (with progress, cached in
Cache Storage). The result is an ordinary :class:`~gpudelegate.program.Program`, as
``gpudelegate.load`` gives on the desktop, except that its ``data`` is a :class:`JsBytes`: a view
of the fetched bytes whose slices (``Program.constant_bytes``) are typed-array views again. The
WebGPU adapter (``web/webgpu.py``) writes them to the GPU as they are, so a 500 MB model does not
also occupy 500 MB of the WebAssembly heap.

Every constant's SHA-256 key is checked like ``gpudelegate.loads`` does (``verify_constant_hashes``),
but while the file arrives: :class:`Download` is fed the bytes in order, a few MB at a time (the
worker's download loop calls ``advance`` as bytes land, or ``verify_all`` for a file read whole,
e.g. from Cache Storage), decodes the header and document with the core's ``read_header`` as soon
as they are there, hashes each constant's byte range and checks the zero padding between them. A
corrupt byte anywhere raises :class:`~gpudelegate.errors.PayloadError` naming the constant (index,
weight name) before anything reaches the GPU.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Dict, List, Optional

import msgpack

from gpudelegate import program as _prog
from gpudelegate.errors import PayloadError
from gpudelegate.program import Program

#: Bytes hashed per step: big enough that the Python <-> JS calls per step cost nothing next to
#: the hashing, small enough that the copy into the WebAssembly heap stays a few MB.
HASH_PIECE = 4 << 20


class JsBytes:
    """Bytes held by JavaScript (a ``Uint8Array``, ``js``), sliced like a memoryview: ``data[a:b]``
    is another JsBytes over the same memory (``subarray``, no copy). ``nbytes`` is its size; the
    WebGPU adapter writes any object with a ``js`` Uint8Array straight to the GPU."""

    __slots__ = ("js", "nbytes")

    def __init__(self, js_array):
        self.js = js_array
        self.nbytes = int(js_array.byteLength)

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("JsBytes supports contiguous slices only (data[a:b])")
        a, b, _ = key.indices(self.nbytes)
        return JsBytes(self.js.subarray(a, max(a, b)))

    def tobytes(self) -> bytes:
        """A copy into Python memory (small constants, tests)."""
        return bytes(self.js.to_bytes())

    __bytes__ = tobytes

    def __repr__(self) -> str:
        return f"JsBytes({self.nbytes} bytes)"


def _is_js(x) -> bool:
    return hasattr(x, "subarray") and hasattr(x, "byteLength")


def head_size(header) -> int:
    """Bytes before the data segment (header + document + padding) given the file's first 64
    bytes. Raises PayloadError for a short or foreign header (the core's checks)."""
    mv = memoryview(header).cast("B")
    if mv.nbytes < _prog.HEADER_SIZE:
        raise PayloadError("header", f"file is {mv.nbytes} bytes, shorter than the {_prog.HEADER_SIZE}-byte header (truncated?)")
    fields = _prog._HEADER.unpack_from(mv, 0)
    if fields[0] != _prog.MAGIC:
        raise PayloadError("header.magic", f"{bytes(fields[0])!r} is not a gpudelegate program (expected {_prog.MAGIC!r})")
    return int(fields[5])


def loads_head(head, total_size: int) -> Program:
    """Decode and validate a program from its head (the bytes before the data segment) knowing
    the file is ``total_size`` bytes long: the core's ``read_header`` checks and the core's
    document validation. The program has no ``data`` yet (:class:`Download` sets it)."""
    from gpudelegate.validate import program_from_document

    mv = memoryview(head).cast("B")
    version, doc_off, doc_size, data_off, data_size = _prog.read_header(mv, total_size=int(total_size))
    try:
        doc = msgpack.unpackb(mv[doc_off:doc_off + doc_size], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types for hostile bytes
        raise PayloadError("document", f"not a valid msgpack document ({type(e).__name__}: {str(e)[:200]})") from None
    return program_from_document(doc, data_size=data_size, header_version=version)


def key_salt(dtype: str, shape) -> bytes:
    """The suffix hashed after a constant's bytes to form its key (``program.constant_key``)."""
    return f"{dtype}{tuple(int(d) for d in shape)}".encode()


def constant_names(program: Program) -> Dict[int, str]:
    """Constant index -> the first value name that refers to it (weights are named by export)."""
    names: Dict[int, str] = {}
    for g in list(program.payloads) + list(program.methods.values()):
        for v in g.values:
            if v.constant is not None and v.name:
                names.setdefault(v.constant, v.name)
    return names


class _Hashing:
    __slots__ = ("index", "start", "end", "sha")

    def __init__(self, index: int, start: int, end: int):
        self.index, self.start, self.end = index, start, end
        self.sha = hashlib.sha256()


class Download:
    """A program file arriving in order into ``data`` (a JS ``Uint8Array`` of the whole file, or
    any Python buffer), verified as it comes.

    ``advance(n)`` says bytes ``[0, n)`` are there; the new ones are hashed in pieces of
    ``piece`` bytes (the tail of a short step waits for the next one). ``verify_all()`` does it for
    a file that is already whole. ``program()`` returns the verified Program once every byte was
    checked. Errors are PayloadErrors: the header's and document's (as ``gpudelegate.loads``), a
    constant whose bytes do not hash to its key, non-zero padding, or a file of another size."""

    def __init__(self, data, total_size: Optional[int] = None, piece: int = HASH_PIECE):
        self.is_js = _is_js(data)
        self.data = data
        size = int(data.byteLength) if self.is_js else memoryview(data).nbytes
        self.total = size if total_size is None else int(total_size)
        if self.total != size:
            raise PayloadError("", f"the download holds {size} bytes but the file is {self.total} bytes")
        self.piece = max(64, int(piece))
        self.pos = 0  # bytes checked so far
        self._program: Optional[Program] = None
        self._data_off = 0
        self._order: List[Any] = []  # constants by offset (data-segment relative), not yet started
        self._next = 0
        self._active: List[_Hashing] = []
        self._covered = 0  # data-segment bytes up to here belong to a started constant
        self._names: Dict[int, str] = {}
        self._scratch: Optional[bytearray] = None
        self.verified = 0  # constants whose key matched
        self.seconds = 0.0  # spent checking (copy into Python + hashing), for the load report

    # ------------------------------------------------------------------ bytes
    def _bytes(self, a: int, b: int) -> memoryview:
        """File bytes [a, b) as a Python memoryview: a JS range is copied into one reused buffer."""
        if not self.is_js:
            return memoryview(self.data).cast("B")[a:b]
        n = b - a
        if self._scratch is None or len(self._scratch) < n:
            self._scratch = bytearray(max(n, min(self.piece, self.total)))
        mv = memoryview(self._scratch)[:n]
        self.data.subarray(a, b).assign_to(mv)
        return mv

    def advance(self, available: int, final: bool = False) -> int:
        """Bytes ``[0, available)`` have arrived: check the ones not checked yet, in whole pieces
        (and the rest when ``final`` or the file is complete). Returns the bytes checked so far."""
        t0 = time.perf_counter()
        try:
            self._advance(min(int(available), self.total), final)
        finally:
            self.seconds += time.perf_counter() - t0
        return self.pos

    def _advance(self, available: int, final: bool) -> None:
        final = final or available == self.total
        while self.pos < available:
            if self._program is None:
                if not self._head(available):
                    break
                continue
            end = min(available, self.pos + self.piece)
            if end - self.pos < self.piece and not final:
                break
            self._data(self._bytes(self.pos, end), self.pos - self._data_off)
            self.pos = end

    def verify_all(self, progress=None) -> Program:
        """Check a file that is already whole (a Cache Storage hit, a test's fetch), piece by
        piece, calling ``progress(done, total)`` after each; returns the program."""
        if self._program is None:
            self.advance(min(self.total, self.head_bytes()), final=True)
        while self.pos < self.total:
            self.advance(min(self.total, self.pos + self.piece), final=True)
            if progress is not None:
                progress(self.pos, self.total)
        return self.program()

    # ------------------------------------------------------------------ header and document
    def head_bytes(self) -> int:
        """Bytes before the data segment (the file's first 64 must be there)."""
        return head_size(self._bytes(0, min(_prog.HEADER_SIZE, self.total)).tobytes())

    def _head(self, available: int) -> bool:
        if available < _prog.HEADER_SIZE and available < self.total:
            return False
        data_off = self.head_bytes()
        if available < min(data_off, self.total):
            return False
        n = min(data_off, self.total)
        prog = loads_head(self._bytes(0, n).tobytes(), self.total)
        self._program, self._data_off = prog, data_off
        self._names = constant_names(prog)
        self._order = sorted(enumerate(prog.constants), key=lambda ic: (ic[1].offset, ic[0]))
        self.pos = data_off
        # Empty constants have no bytes to wait for.
        for i, c in self._order:
            if c.nbytes == 0:
                self._finish(_Hashing(i, c.offset, c.offset))
        self._order = [(i, c) for i, c in self._order if c.nbytes]
        return True

    def _where(self, i: int) -> str:
        name = self._names.get(i)
        return f"constants[{i}]" + (f" ({name!r})" if name else "")

    # ------------------------------------------------------------------ data segment
    def _zero(self, mv: memoryview, a: int, b: int, base: int) -> None:
        """Data-segment bytes [a, b) (in ``mv`` from ``base``) belong to no constant: zero."""
        if a < b and bytes(mv[a - base:b - base]).count(0) != b - a:
            raise PayloadError("data", f"padding bytes in [{a}, {b}) of the data segment are not zero (corrupt file)")

    def _data(self, mv: memoryview, base: int) -> None:
        """Data-segment bytes [base, base + len(mv))."""
        end = base + len(mv)
        cur = base
        while True:
            nxt = self._order[self._next][1].offset if self._next < len(self._order) else end
            self._zero(mv, max(cur, self._covered), min(nxt, end), base)
            if nxt >= end:
                break
            i, c = self._order[self._next]
            self._active.append(_Hashing(i, c.offset, c.offset + c.nbytes))
            self._covered = max(self._covered, c.offset + c.nbytes)
            self._next += 1
            cur = nxt
        still = []
        for h in self._active:
            a, b = max(h.start, base), min(h.end, end)
            if a < b:
                h.sha.update(mv[a - base:b - base])
            if h.end <= end:
                self._finish(h)
            else:
                still.append(h)
        self._active = still

    def _finish(self, h: _Hashing) -> None:
        c = self._program.constants[h.index]
        h.sha.update(key_salt(c.dtype, c.shape))
        key = h.sha.hexdigest()
        if key != c.key:
            raise PayloadError(self._where(h.index),
                               f"bytes at data[{c.offset}:{c.offset + c.nbytes}] hash to {key[:16]}... but the key is "
                               f"{c.key[:16]}... (corrupt download or cached copy)")
        self.verified += 1

    # ------------------------------------------------------------------ result
    def program(self) -> Program:
        """The verified Program; its ``data`` is the data segment (a JsBytes in the browser)."""
        if self._program is None or self.pos < self.total or self._active or self._next < len(self._order):
            raise PayloadError("", f"the program was checked up to byte {self.pos} of {self.total}: "
                                   f"{'truncated download' if self.pos < self.total else 'constants past the data segment'}")
        prog = self._program
        if prog.data is None:
            if self.is_js:
                prog.data = JsBytes(self.data.subarray(self._data_off, self.total))
            else:
                prog.data = memoryview(self.data).cast("B")[self._data_off:self.total]
        return prog


def program_from_bytes(data, progress=None, piece: int = HASH_PIECE) -> Program:
    """A whole program file (JS Uint8Array or Python buffer) -> a verified Program."""
    return Download(data, piece=piece).verify_all(progress)


__all__ = ["JsBytes", "Download", "HASH_PIECE", "head_size", "loads_head", "key_salt", "constant_names",
           "program_from_bytes"]
