"""The program file: typed in-memory form, writer and reader.

Layout on disk (little endian)::

    0   magic  b"GPUDLGT\\0"            8 bytes
    8   format version                  u32
    12  header size (64)                u32
    16  document offset                 u64
    24  document size                   u64
    32  data segment offset (64-aligned) u64
    40  data segment size               u64
    48  SHA-256 of the document, first 16 bytes (a flipped bit in the document is caught even when
        it still decodes to a valid but different program)
    64  msgpack document
    ..  zero padding to 64
    data segment: every constant at a 64-byte aligned offset (relative to the segment)

The document is a map ``{"version", "constants", "payloads", "methods", "metadata"}``. Constants
are keyed by the SHA-256 of their bytes and stored once whatever number of methods and payloads
use them. A method is a graph whose nodes are host ops or ``delegate`` calls into a payload; a
payload is the graph one backend received from ``preprocess_all`` plus its prepack entries and
offload schedule. Values are tensors only (dtype, static shape, optional constant index); op
parameters are plain msgpack attributes on the node.

Decoding never trusts the file: see :mod:`gpudelegate.document` for the checks, all of which raise
:class:`~gpudelegate.errors.PayloadError` naming the path inside the document.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import msgpack

from . import dtypes as _dt
from .document import program_fields, verify_constant_hashes
from .errors import PayloadError
# The graph types and format constants live in .graph (the document checks build them without
# importing this module); they are re-exported here, where programs have always found them.
from .graph import (ALIGN, DELEGATE_OP, FORMAT_VERSION, SUPPORTED_VERSIONS, Constant, Graph, Method, Node,
                    OffloadSchedule, Payload, PrepackEntry, Value, align_up, constant_key)

MAGIC = b"GPUDLGT\x00"
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQQQ16s")
assert _HEADER.size == HEADER_SIZE


def document_digest(doc: bytes) -> bytes:
    return hashlib.sha256(doc).digest()[:16]


def pack_header(version: int, doc: bytes, data_size: int) -> bytes:
    """The 64-byte header for a document followed (at the next 64-byte boundary) by the data."""
    return _HEADER.pack(MAGIC, version, HEADER_SIZE, HEADER_SIZE, len(doc), align_up(HEADER_SIZE + len(doc)),
                        data_size, document_digest(doc))


@dataclass
class Program:
    constants: List[Constant]
    payloads: List[Payload]
    methods: Dict[str, Method]
    metadata: Dict[str, Any] = field(default_factory=dict)
    # Constant bytes: either a loaded data segment (``data``, offsets from Constant.offset) or, for
    # a program being built, ``blobs`` keyed by constant key.
    data: Optional[memoryview] = None
    blobs: Dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    # ----------------------------------------------------------------- constants
    def constant_bytes(self, index: int) -> memoryview:
        c = self.constants[index]
        if c.key in self.blobs:
            return _dt.byte_view(self.blobs[c.key])
        if self.data is None:
            raise PayloadError(f"constants[{index}]", "no bytes for this constant (program has no data segment)")
        return self.data[c.offset:c.offset + c.nbytes]

    def add_constant(self, dtype: str, shape, data) -> int:
        """Add (or find) a constant by content; returns its index. ``data`` is any buffer."""
        mv = _dt.byte_view(data)  # an empty constant (a zero-size dim) has no bytes
        shape = tuple(int(d) for d in shape)
        if _dt.is_packed(dtype) and _dt.packed_shape_error(dtype, shape):
            raise PayloadError("constants", _dt.packed_shape_error(dtype, shape))
        if mv.nbytes != _dt.nbytes(dtype, shape):
            raise PayloadError("constants", f"{mv.nbytes} bytes given for {dtype}{list(shape)}")
        key = constant_key(dtype, shape, mv)
        for i, c in enumerate(self.constants):
            if c.key == key:
                return i
        self.constants.append(Constant(key, dtype, shape, mv.nbytes))
        self.blobs[key] = mv
        return len(self.constants) - 1

    @property
    def constant_bytes_total(self) -> int:
        return sum(c.nbytes for c in self.constants)

    # ----------------------------------------------------------------- io
    def to_bytes(self) -> bytes:
        out = bytearray()
        for chunk in iter_program_chunks(self):
            out += chunk
        return bytes(out)

    def save(self, path, progress=None) -> int:
        """Write the program file; returns its size. ``progress(done, total)`` is called as
        constant bytes are written.

        The bytes go to a temporary file next to ``path`` that is then renamed over it
        (``os.replace``, atomic on POSIX and Windows): an existing file at ``path`` is never
        truncated, so a program loaded from it (memory-mapped: its constants are read from the
        mapping) keeps reading the old bytes, also while this very program, loaded from ``path``,
        is saved back to ``path``. A failed write leaves ``path`` as it was."""
        import os
        import secrets

        path = os.fspath(path)
        folder, base = os.path.split(os.path.abspath(path))
        tmp = os.path.join(folder, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        size = 0
        try:
            with open(tmp, "xb") as f:  # created with the default mode (umask), like open(path, "wb")
                for chunk in iter_program_chunks(self, progress=progress):
                    f.write(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())  # the rename must not publish a file whose bytes are not on disk
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return size

    @property
    def method_names(self) -> List[str]:
        return list(self.methods)


# --------------------------------------------------------------------- to/from plain documents

def _value_doc(v: Value) -> dict:
    d = {"dtype": v.dtype, "shape": list(v.shape)}
    if v.constant is not None:
        d["constant"] = v.constant
    if v.name:
        d["name"] = v.name
    return d


def _graph_doc(g: Graph) -> dict:
    return {
        "values": [_value_doc(v) for v in g.values],
        "inputs": list(g.inputs),
        "outputs": list(g.outputs),
        "ops": [{"op": n.op, "args": list(n.args), "outputs": list(n.outputs), "attrs": dict(n.attrs)}
                for n in g.nodes],
    }


def program_document(p: Program) -> dict:
    payloads = []
    for pl in p.payloads:
        d = _graph_doc(pl)
        d["backend"] = pl.backend
        d["prepack"] = [{"src": e.src, "dst": e.dst, "layout": e.layout} for e in pl.prepack]
        if pl.offload is not None:
            d["offload"] = {"reads": [list(r) for r in pl.offload.reads]}
        payloads.append(d)
    return {
        "version": p.version,
        "constants": [{"key": c.key, "dtype": c.dtype, "shape": list(c.shape), "nbytes": c.nbytes,
                       "offset": c.offset} for c in p.constants],
        "payloads": payloads,
        "methods": {name: _graph_doc(m) for name, m in p.methods.items()},
        "metadata": p.metadata,
    }


def iter_program_chunks(p: Program, progress=None, chunk_bytes: int = 8 << 20):
    """Yield the file's bytes in pieces (header+document, then constants) so large programs are
    written without building one giant buffer."""
    # Assign 64-aligned offsets in the data segment.
    off = 0
    for c in p.constants:
        c.offset = off
        off = align_up(off + c.nbytes)
    data_size = off
    doc = msgpack.packb(program_document(p), use_bin_type=True)
    data_offset = align_up(HEADER_SIZE + len(doc))
    header = pack_header(p.version, doc, data_size)
    yield header + doc + bytes(data_offset - HEADER_SIZE - len(doc))
    done = 0
    total = p.constant_bytes_total
    for i, c in enumerate(p.constants):
        mv = p.constant_bytes(i)
        for s in range(0, c.nbytes, chunk_bytes):
            piece = mv[s:s + chunk_bytes]
            yield bytes(piece)
            done += len(piece)
            if progress is not None:
                progress(done, total)
        pad = align_up(c.nbytes) - c.nbytes
        if pad:
            yield bytes(pad)


def read_header(buf, total_size: Optional[int] = None) -> Tuple[int, int, int, int, int]:
    """Parse and check the fixed header against the whole file; returns (version, doc_offset,
    doc_size, data_offset, data_size). Raises PayloadError for short, foreign, or inconsistent
    headers. The layout must be exactly the writer's (document right after the header, zero
    padding up to a 64-aligned data segment that ends the file), so a damaged size or offset field
    is refused here rather than silently reading a shifted document or data segment.

    ``total_size``: the file's size when ``buf`` is only its head, the bytes before the data
    segment (the browser decodes a download before its data segment has arrived); the checks are
    the same."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < HEADER_SIZE:
        raise PayloadError("header", f"file is {mv.nbytes} bytes, shorter than the {HEADER_SIZE}-byte header (truncated?)")
    magic, version, hsize, doc_off, doc_size, data_off, data_size, digest = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise PayloadError("header.magic", f"{bytes(magic)!r} is not a gpudelegate program (expected {MAGIC!r})")
    if version not in SUPPORTED_VERSIONS:
        raise PayloadError("header.version", f"format version {version} is not supported (this build reads {list(SUPPORTED_VERSIONS)})")
    if hsize != HEADER_SIZE:
        raise PayloadError("header.header_size", f"{hsize} (expected {HEADER_SIZE})")
    if doc_off != HEADER_SIZE:
        raise PayloadError("header.document_offset", f"{doc_off} (expected {HEADER_SIZE})")
    if doc_size == 0:
        raise PayloadError("header.document_size", "0: the document is empty")
    if data_off % ALIGN:
        raise PayloadError("header.data_offset", f"{data_off} is not {ALIGN}-byte aligned")
    if doc_off + doc_size > data_off:
        raise PayloadError("header.document_size", f"document [{doc_off}, {doc_off + doc_size}) overlaps the data segment at {data_off}")
    if data_off != align_up(doc_off + doc_size):
        raise PayloadError("header.data_offset", f"{data_off} but the document ends at {doc_off + doc_size}: the data "
                                                 f"segment starts at the next {ALIGN}-byte boundary, {align_up(doc_off + doc_size)}")
    if data_size % ALIGN:
        raise PayloadError("header.data_size", f"{data_size} is not a multiple of {ALIGN}")
    size = mv.nbytes if total_size is None else int(total_size)
    if total_size is not None and mv.nbytes < min(data_off, size):
        raise PayloadError("header.data_offset", f"{data_off} but only {mv.nbytes} head bytes were given")
    if data_off + data_size > size:
        raise PayloadError("header.data_size", f"data segment [{data_off}, {data_off + data_size}) runs past the end of the "
                                               f"{size}-byte file (truncated?)")
    if data_off + data_size < size:
        raise PayloadError("header.data_size", f"data segment [{data_off}, {data_off + data_size}) ends before the end of the "
                                               f"{size}-byte file ({size - data_off - data_size} trailing bytes)")
    if any(mv[doc_off + doc_size:data_off]):
        raise PayloadError("header.document_size", f"padding bytes [{doc_off + doc_size}, {data_off}) after the document are "
                                                   f"not zero (wrong document size or corrupt file)")
    if document_digest(mv[doc_off:doc_off + doc_size]) != digest:
        raise PayloadError("header.document_sha256", "does not match the document (corrupt document or header)")
    return version, doc_off, doc_size, data_off, data_size


def program_from_document(doc: Any, data_size: int, header_version: int) -> Program:
    """Build the typed program from a decoded document, or raise PayloadError naming the path
    (the checks: :mod:`.document`)."""
    return Program(**program_fields(doc, data_size=data_size, header_version=header_version))


def _decode_head(mv: memoryview, total_size: Optional[int] = None) -> Tuple[Program, int, int]:
    """The program of a file's head (``mv``: at least the bytes before the data segment), checked as
    ``read_header`` and :mod:`.document` check it, without its data; with the data segment's
    offset and size."""
    version, doc_off, doc_size, data_off, data_size = read_header(mv, total_size)
    try:
        # unpackb sets max_{str,bin,array,map,ext}_len from the input's length, so a claimed
        # 2**32-element array fails before any list is built; nesting is capped at 1024 levels.
        doc = msgpack.unpackb(mv[doc_off:doc_off + doc_size], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types for hostile bytes
        msg = str(e)[:200]
        raise PayloadError("document", f"not a valid msgpack document ({type(e).__name__}: {msg})") from None
    return program_from_document(doc, data_size=data_size, header_version=version), data_off, data_size


def loads(buf, verify_hashes: bool = True) -> Program:
    """Decode and validate a program from bytes (or any buffer, e.g. an mmap). The returned
    program's ``data`` is a view into ``buf`` (no copy). Hostile bytes raise PayloadError only;
    msgpack bounds every container by the document's size, so nothing allocates more than the
    file justifies."""
    mv = memoryview(buf).cast("B")
    prog, data_off, data_size = _decode_head(mv)
    prog.data = mv[data_off:data_off + data_size]
    if verify_hashes:
        verify_constant_hashes(prog)
    return prog


# Reading a data segment into the caller's memory (``load(..., data_memory=)``): parts of at least
# 16 MiB, one per thread, so a large file's read (copies out of the page cache, or the disk's
# queue) runs on several cores; a small file is one read on the caller's thread.
READ_PART = 16 << 20
READ_THREADS = 8


def _writable_bytes(memory, nbytes: int) -> memoryview:
    """The first ``nbytes`` of ``memory`` (what ``data_memory`` returned) as a writable byte view,
    or InputError saying what is wrong with it."""
    from .errors import InputError

    try:
        mv = memoryview(memory)
    except TypeError:
        raise InputError(f"load(): data_memory({nbytes}) returned {type(memory).__name__}, "
                         f"not a buffer (e.g. a bytearray or a writable memoryview)") from None
    if mv.readonly:
        raise InputError(f"load(): data_memory({nbytes}) returned a read-only buffer")
    if not mv.c_contiguous:
        raise InputError(f"load(): data_memory({nbytes}) returned a non-contiguous buffer")
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if mv.nbytes < nbytes:
        raise InputError(f"load(): data_memory({nbytes}) returned {mv.nbytes} bytes, "
                         f"fewer than the data segment's {nbytes}")
    return mv[:nbytes]


def _read_exactly(f, offset: int, into: memoryview, path: str, size: int) -> None:
    """Fill ``into`` with the file's bytes from ``offset`` (positioned reads where the platform has
    them, so threads share the descriptor), or PayloadError naming the file when it ends first."""
    import os

    fd = f.fileno()
    pread = getattr(os, "preadv", None)
    done, n = 0, into.nbytes
    while done < n:
        try:
            if pread is not None:
                got = pread(fd, [into[done:]], offset + done)
            else:  # one caller at a time on this path (no threads without preadv)
                f.seek(offset + done)
                got = f.readinto(into[done:])
        except OSError as e:
            raise PayloadError("", f"cannot read program file {path!r}: {e.strerror or e}") from None
        if not got:
            raise PayloadError("", f"cannot read program file {path!r}: it ends at byte {offset + done}, "
                                   f"{size} when opened (truncated while loading?)")
        done += got


def _read_segment(f, offset: int, into: memoryview, path: str, size: int) -> None:
    """Read the data segment into ``into``: in parts on several threads when it is large and the
    platform has threads and positioned reads (not Pyodide), else in one read."""
    import os
    import sys

    n = into.nbytes
    threads = min(READ_THREADS, os.cpu_count() or 1, n // READ_PART)
    if threads < 2 or sys.platform == "emscripten" or not hasattr(os, "preadv"):
        _read_exactly(f, offset, into, path, size)
        return
    from concurrent.futures import ThreadPoolExecutor

    step = -(-n // threads)
    step = -(-step // 4096) * 4096  # whole pages per part: no two threads write into one page
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpudelegate-load") as pool:
        parts = [pool.submit(_read_exactly, f, offset + a, into[a:a + step], path, size) for a in range(0, n, step)]
        for p in parts:
            p.result()  # the first part's error, if any, after every part has stopped


def load(path, verify_hashes: bool = True, data_memory=None) -> Program:
    """Load a program file. On desktop the file is memory-mapped (constants are not copied).

    A path that is not a str/PathLike raises InputError; a file that cannot be read (missing, a
    directory, no permission) raises PayloadError naming it. For a mapped file the program keeps
    ``source_file = (path, (st_dev, st_ino, st_size, st_mtime_ns), mapping,
    document digest)``: a session built from the program checks that the mapped bytes did not
    change since this load (see ``gpudelegate.session.check_source_unchanged``).

    ``data_memory(nbytes) -> buffer``: read the data segment into memory of the caller's instead
    of mapping the file, e.g. memory the GPU reads itself (``DawnContext.gpu_readable_memory``:
    prepack is then the GPU's copies alone, the host's copy having moved here). It is called once
    with the segment's size (not for an empty segment) and must return a writable, contiguous
    buffer of at least that many bytes (InputError otherwise); the program's ``data`` is a
    read-only view of its first ``nbytes``, which keeps the buffer alive as long as the program
    or anything sliced from its data. Header, document and constant hashes are checked as for a
    mapped file. Such a program never reads the file again, so it has no ``source_file``: a
    later change of the file cannot reach it."""
    import mmap
    import os

    from .errors import InputError

    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"load() takes a file path (str or os.PathLike), got {type(path).__name__}"
                         + (" (use gpudelegate.loads for bytes)" if isinstance(path, (bytes, bytearray, memoryview)) else ""))
    if data_memory is not None and not callable(data_memory):
        raise InputError(f"load(): data_memory must be a callable(nbytes) -> writable buffer, "
                         f"got {type(data_memory).__name__}")

    def unreadable(e: Exception) -> PayloadError:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return PayloadError("", f"cannot read program file {os.fspath(path)!r}: {why}")

    try:
        f = open(path, "rb")
        st = os.fstat(f.fileno())
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise unreadable(e) from None
    with f:
        if data_memory is not None:  # its reads say what went wrong themselves
            return _load_into(f, os.fspath(path), st.st_size, data_memory, verify_hashes)
        try:
            try:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (ValueError, OSError):  # empty file, or a platform without mmap (Pyodide)
                m = f.read()
        except OSError as e:
            raise unreadable(e) from None
    prog = loads(m, verify_hashes=verify_hashes)
    if isinstance(m, mmap.mmap):
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        prog.source_file = (os.path.abspath(os.fspath(path)), ident, m, bytes(m[48:64]))
    return prog


def _load_into(f, path: str, size: int, data_memory, verify_hashes: bool) -> Program:
    """``load`` with ``data_memory``: the head read and decoded first (a bad file fails before
    anything is allocated), then the data segment read into the caller's memory."""
    head = bytearray(min(HEADER_SIZE, size))
    _read_exactly(f, 0, memoryview(head), path, size)
    if len(head) == HEADER_SIZE:
        # the rest of the head, up to the data segment the header claims (at most the whole file;
        # read_header then checks that claim, a bad one in the first 64 bytes already)
        data_off = _HEADER.unpack_from(head, 0)[5]
        whole = bytearray(min(size, max(HEADER_SIZE, data_off)))
        whole[:HEADER_SIZE] = head
        _read_exactly(f, HEADER_SIZE, memoryview(whole)[HEADER_SIZE:], path, size)
        head = whole
    prog, data_off, data_size = _decode_head(memoryview(head), total_size=size)
    if data_size:
        into = _writable_bytes(data_memory(data_size), data_size)
        _read_segment(f, data_off, into, path, size)
        prog.data = into.toreadonly()
    else:
        prog.data = memoryview(b"")
    if verify_hashes:
        verify_constant_hashes(prog)
    return prog
