"""Every check of core/validate.py: a bad document raises the documented type, and the message
starts with the path of the bad field inside the document.

Each case takes the valid document of progbuild.sample_program(), changes one thing, writes a
file around it and loads it. Pure core (listed in tests/core_tests.txt): no numpy.
"""

import copy
import re

import msgpack
import pytest

import gpudelegate
from gpudelegate import PayloadError, UnsupportedOpError
from gpudelegate import document, validate
from gpudelegate.program import program_document
from progbuild import ProgramBuilder, file_bytes, rand_floats, sample_program, split_file

DOC, DATA = split_file(sample_program().to_bytes())
_TOKEN = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]")


def _keys(path):
    return [int(i) if i else k for k, i in _TOKEN.findall(path)]


def _get(doc, path):
    for k in _keys(path):
        doc = doc[k]
    return doc


def _set(path, value):
    def mutate(doc):
        *head, last = _keys(path)
        parent = doc
        for k in head:
            parent = parent[k]
        parent[last] = value
    return mutate


def _del(path):
    def mutate(doc):
        *head, last = _keys(path)
        parent = doc
        for k in head:
            parent = parent[k]
        del parent[last]
    return mutate


def _do(*fns):
    def mutate(doc):
        for f in fns:
            f(doc)
    return mutate


def _swap_decode_ops(doc):
    ops = doc["methods"]["decode"]["ops"]
    ops[0], ops[1] = ops[1], ops[0]


def _output_unproduced_value(doc):
    f = doc["methods"]["forward"]
    f["values"].append({"dtype": "float32", "shape": [7, 5]})
    f["outputs"] = [3]


def _delegate_inside_payload(doc):
    p = doc["payloads"][0]
    p["values"].append({"dtype": "float32", "shape": [7, 5]})
    p["ops"].append({"op": "delegate", "args": [6], "outputs": [7], "attrs": {"payload": 1}})
    p["offload"]["reads"].append([])


def _rename_method(name):
    def mutate(doc):
        m = doc["methods"]
        m[name] = m.pop("forward")
    return mutate


def _kv_update_into_constant(doc):
    # A cache that is a program constant: the update would write into the shared (on desktop,
    # memory-mapped read-only) constant bytes. Refused before shape inference looks at it.
    s = doc["methods"]["step"]
    s["values"] += [{"dtype": "float32", "shape": [5, 3], "constant": 0}, {"dtype": "float32", "shape": [5, 3]}]
    s["ops"].append({"op": "kv_update", "args": [4, 1, 2], "outputs": [5], "attrs": {}})


def _kv_update_into_view_of_prepacked(doc):
    p = doc["payloads"][0]
    p["values"] += [{"dtype": "float32", "shape": [1, 1, 5, 3]},  # 7: view of prepacked w (value 2)
                    {"dtype": "float32", "shape": [1, 1, 5, 3]},  # 8: view of the view
                    {"dtype": "int32", "shape": [1]},  # 9: pos, computed
                    {"dtype": "float32", "shape": [1, 1, 5, 3]}]  # 10
    p["inputs"].append(9)
    p["ops"] += [{"op": "reshape", "args": [2], "outputs": [7], "attrs": {"shape": [1, 1, 5, 3]}},
                 {"op": "reshape", "args": [7], "outputs": [8], "attrs": {"shape": [1, 1, 5, 3]}},
                 {"op": "kv_update", "args": [8, 8, 9], "outputs": [10], "attrs": {}}]
    p["offload"]["reads"] += [[2], [], []]


def _deep(n):
    x = 1
    for _ in range(n):
        x = [x]
    return x


K0 = DOC["constants"][0]["key"]
P = PayloadError
U = UnsupportedOpError

CASES = [
    # ------------------------------------------------------------- top level
    ("doc-not-a-map", lambda d: [], P, "document", "expected a map"),
    ("doc-missing-methods", _del("methods"), P, "document", "missing field 'methods'"),
    ("doc-unknown-field", _set("extra", 1), P, "document", "unknown field 'extra'"),
    ("version-string", _set("version", "1"), P, "version", "expected an integer"),
    ("version-bool", _set("version", True), P, "version", "expected an integer"),
    ("metadata-list", _set("metadata", [1]), P, "metadata", "expected a map"),
    ("metadata-too-deep", _set("metadata", {"a": _deep(40)}), P, "metadata.a" + "[0]" * 31, "nested more than 32"),
    ("metadata-bytes-key", _set("metadata", {b"k": 1}), P, "metadata", "is not a string"),
    ("metadata-ext", _set("metadata", {"x": msgpack.ExtType(5, b"ab")}), P, "metadata.x", "not plain data"),
    # ------------------------------------------------------------- constants
    ("constants-map", _set("constants", {}), P, "constants", "expected a list"),
    ("const-key-short", _set("constants[0].key", "abc"), P, "constants[0].key", "SHA-256"),
    ("const-key-upper", _set("constants[0].key", K0.upper()), P, "constants[0].key", "SHA-256"),
    ("const-key-dup", _set("constants[1].key", K0), P, "constants[1].key", "duplicate of constants[0]"),
    ("const-dtype", _set("constants[0].dtype", "float64"), P, "constants[0].dtype", "unknown dtype 'float64'"),
    ("const-rank", _set("constants[0].shape", [1] * 9), P, "constants[0].shape", "rank 9 exceeds the maximum of 8"),
    ("const-neg-dim", _set("constants[0].shape", [5, -3]), P, "constants[0].shape[1]", "-3 out of range"),
    ("const-float-dim", _set("constants[0].shape", [5.0, 3]), P, "constants[0].shape[0]", "expected an integer"),
    ("const-bool-dim", _set("constants[0].shape", [True, 3]), P, "constants[0].shape[0]", "expected an integer"),
    ("const-shape-str", _set("constants[0].shape", "5x3"), P, "constants[0].shape", "expected a list"),
    ("const-nbytes", _set("constants[0].nbytes", 64), P, "constants[0].nbytes", "64 but float32[5, 3] is 60 bytes"),
    ("const-nbytes-bool", _set("constants[0].nbytes", True), P, "constants[0].nbytes", "expected an integer"),
    ("const-absurd", _do(_set("constants[0].shape", [1 << 20, 1 << 20]), _set("constants[0].nbytes", 1 << 42)),
     P, "constants[0].shape", "over the 1099511627776-byte limit"),
    ("const-unaligned", _set("constants[1].offset", 32), P, "constants[1].offset", "not 64-byte aligned"),
    ("const-past-end", _set("constants[1].offset", 128), P, "constants[1].offset", "run past the 128-byte data segment"),
    ("const-overlap", _set("constants[1].offset", 0), P, "constants[1].offset", "overlap constants[0]"),
    ("const-unknown-field", _set("constants[0].stride", 1), P, "constants[0]", "unknown field 'stride'"),
    ("const-missing-offset", _del("constants[0].offset"), P, "constants[0]", "missing field 'offset'"),
    # ------------------------------------------------------------- values
    ("value-const-range", _set("payloads[0].values[1].constant", 2), P, "payloads[0].values[1].constant",
     "constant 2 out of range (0..1)"),
    ("value-const-neg", _set("methods.decode.values[2].constant", -1), P, "methods.decode.values[2].constant",
     "out of range"),
    ("value-const-mismatch", _set("payloads[0].values[1].constant", 1), P, "payloads[0].values[1]",
     "declared float32[5, 3] but constants[1] is float32[5]"),
    ("value-name-int", _set("payloads[0].values[0].name", 3), P, "payloads[0].values[0].name", "expected a string"),
    ("value-dtype", _set("payloads[0].values[0].dtype", "int64"), P, "payloads[0].values[0].dtype", "unknown dtype"),
    ("value-absurd", _set("methods.step.values[0].shape", [1 << 20] * 3), P, "methods.step.values[0].shape",
     "over the"),
    ("value-not-map", _set("payloads[1].values[0]", [7, 5]), P, "payloads[1].values[0]", "expected a map"),
    # ------------------------------------------------------------- graph inputs/outputs
    ("input-range", _set("methods.forward.inputs", [99]), P, "methods.forward.inputs[0]", "value 99 out of range (0..2)"),
    ("input-twice", _set("methods.step.inputs", [0, 1, 2, 0]), P, "methods.step.inputs[3]", "listed twice"),
    ("input-constant", _set("methods.decode.inputs", [0, 2]), P, "methods.decode.inputs[1]", "is a constant"),
    ("input-not-list", _set("payloads[1].inputs", "0"), P, "payloads[1].inputs", "expected a list"),
    ("output-range", _set("methods.forward.outputs", [2, 5]), P, "methods.forward.outputs[1]", "out of range"),
    ("output-unproduced", _output_unproduced_value, P, "methods.forward.outputs[0]", "value 3 is never produced"),
    # ------------------------------------------------------------- nodes
    ("op-unknown", _set("methods.decode.ops[1].op", "frobnicate"), U, "methods.decode.ops[1].op", "unknown op 'frobnicate'"),
    ("op-not-str", _set("methods.decode.ops[1].op", 7), P, "methods.decode.ops[1].op", "expected a string"),
    ("arg-range", _set("methods.decode.ops[1].args[1]", 999), P, "methods.decode.ops[1].args[1]",
     "value 999 out of range (0..3)"),
    ("arg-bool", _set("methods.decode.ops[1].args[1]", False), P, "methods.decode.ops[1].args[1]", "expected a value id"),
    ("arg-before-def", _swap_decode_ops, P, "methods.decode.ops[0].args[0]", "value 1 is used before it is defined"),
    ("arg-absent-required", _set("methods.decode.ops[1].args", [1, -1]), P, "methods.decode.ops[1]",
     "required but absent"),
    ("arg-too-many", _set("payloads[1].ops[0].args", [0, 0]), P, "payloads[1].ops[0]", "takes 1 args, got 2"),
    ("out-twice", _set("methods.decode.ops[1].outputs", [1]), P, "methods.decode.ops[1].outputs[0]",
     "already produced by methods.decode.ops[0]"),
    ("out-twice-same-node", _set("payloads[1].ops[0].outputs", [1, 1]), P, "payloads[1].ops[0].outputs[1]",
     "already produced"),
    ("out-constant", _set("methods.decode.ops[1].outputs", [2]), P, "methods.decode.ops[1].outputs[0]",
     "value 2 is a constant"),
    ("out-graph-input", _set("methods.step.ops[0].outputs", [0]), P, "methods.step.ops[0].outputs[0]",
     "value 0 is a graph input"),
    ("out-prepack-dst", _set("payloads[0].ops[0].outputs", [2]), P, "payloads[0].ops[0].outputs[0]",
     "destination of payloads[0].prepack[0]"),
    ("out-none", _set("payloads[1].ops[0].outputs", []), P, "payloads[1].ops[0].outputs", "at least one value"),
    ("out-count", _do(_set("payloads[1].values", DOC["payloads"][1]["values"] * 2),
                      _set("payloads[1].ops[0].outputs", [1, 2])), P, "payloads[1].ops[0].outputs",
     "softmax produces 1 value(s), 2 declared"),
    ("infer-shape", _set("methods.decode.values[3].shape", [7, 7]), P, "methods.decode.ops[1].outputs[0]",
     "value 3 is declared float32[7, 7] but add infers float32[7, 5]"),
    ("infer-dtype", _set("methods.decode.values[3].dtype", "float16"), P, "methods.decode.ops[1].outputs[0]",
     "but add infers float32[7, 5]"),
    ("infer-kv-shape", _set("methods.step.values[1].shape", [1, 2, 1, 4]), P, "methods.step.ops[0]", "kv_update"),
    ("kv-into-constant", _kv_update_into_constant, P, "methods.step.ops[1].args[0]",
     "kv_update would write in place into weight value 4"),
    ("kv-into-view-of-prepacked", _kv_update_into_view_of_prepacked, P, "payloads[0].ops[4].args[0]",
     "would write in place into weight value 8"),
    ("attr-type", _set("payloads[1].ops[0].attrs", {"dim": "x"}), P, "payloads[1].ops[0]", "attrs.dim"),
    ("attr-range", _set("payloads[1].ops[0].attrs", {"dim": 5}), P, "payloads[1].ops[0]", "dim"),
    ("attr-unknown", _set("payloads[1].ops[0].attrs", {"bogus": 1}), P, "payloads[1].ops[0]", "unknown attribute"),
    ("attr-map-value", _set("payloads[1].ops[0].attrs", {"dim": {"a": 1}}), P, "payloads[1].ops[0].attrs.dim",
     "not plain data"),
    ("attr-too-deep", _set("payloads[1].ops[0].attrs", {"dim": _deep(6)}), P, "payloads[1].ops[0].attrs.dim[0][0][0]",
     "nested more than 4"),
    ("attrs-list", _set("payloads[1].ops[0].attrs", [1]), P, "payloads[1].ops[0].attrs", "expected a map"),
    ("node-missing-args", _del("payloads[1].ops[0].args"), P, "payloads[1].ops[0]", "missing field 'args'"),
    ("node-unknown-field", _set("payloads[1].ops[0].alias", 0), P, "payloads[1].ops[0]", "unknown field 'alias'"),
    ("ops-not-list", _set("payloads[1].ops", {}), P, "payloads[1].ops", "expected a list"),
    # ------------------------------------------------------------- delegate
    ("delegate-in-payload", _delegate_inside_payload, P, "payloads[0].ops[2].op", "only allowed in methods"),
    ("delegate-payload-range", _set("methods.forward.ops[0].attrs.payload", 2), P,
     "methods.forward.ops[0].attrs.payload", "payload 2 out of range (0..1)"),
    ("delegate-payload-bool", _set("methods.forward.ops[0].attrs.payload", True), P,
     "methods.forward.ops[0].attrs.payload", "expected an integer"),
    ("delegate-no-payload", _set("methods.forward.ops[0].attrs", {}), P, "methods.forward.ops[0].attrs",
     "needs attrs.payload"),
    ("delegate-arg-count", _set("methods.forward.ops[0].args", [0, 0]), P, "methods.forward.ops[0].args",
     "2 given but payloads[0] has 1 inputs"),
    ("delegate-arg-absent", _set("methods.forward.ops[0].args", [-1]), P, "methods.forward.ops[0].args[0]",
     "value -1 out of range"),
    ("delegate-arg-shape", _set("methods.forward.ops[1].attrs.payload", 0), P, "methods.forward.ops[1].args[0]",
     "value 1 is float32[7, 5] but payloads[0].inputs[0] is float32[7, 3]"),
    ("delegate-out-dtype", _set("methods.decode.values[1].dtype", "float16"), P, "methods.decode.ops[0].outputs[0]",
     "value 1 is float16[7, 5] but payloads[0].outputs[0] is float32[7, 5]"),
    ("delegate-out-count", _set("methods.forward.ops[1].outputs", [2, 1]), P, "methods.forward.ops[1].outputs[1]",
     "already produced"),
    # ------------------------------------------------------------- payloads, prepack
    ("payloads-map", _set("payloads", {}), P, "payloads", "expected a list"),
    ("backend-empty", _set("payloads[0].backend", ""), P, "payloads[0].backend", "empty string"),
    ("backend-int", _set("payloads[0].backend", 1), P, "payloads[0].backend", "expected a string"),
    ("payload-no-prepack", _del("payloads[1].prepack"), P, "payloads[1]", "missing field 'prepack'"),
    ("prepack-src-range", _set("payloads[0].prepack[0].src", 50), P, "payloads[0].prepack[0].src",
     "value 50 out of range (0..6)"),
    ("prepack-src-not-const", _set("payloads[0].prepack[0].src", 0), P, "payloads[0].prepack[0].src", "not a constant"),
    ("prepack-dst-const", _set("payloads[0].prepack[0].dst", 1), P, "payloads[0].prepack[0].dst", "is a constant"),
    ("prepack-dst-input", _set("payloads[0].prepack[0].dst", 0), P, "payloads[0].prepack[0].dst", "graph input"),
    ("prepack-dst-twice", _set("payloads[0].prepack[1].dst", 2), P, "payloads[0].prepack[1].dst",
     "already the destination of payloads[0].prepack[0]"),
    ("prepack-identity-shape", _set("payloads[0].values[2].shape", [3, 5]), P, "payloads[0].prepack[0]",
     "identity layout needs equal dtype and shape"),
    ("prepack-fp16-dtype", _set("payloads[0].prepack[0].layout", "fp16"), P, "payloads[0].prepack[0]",
     "fp16 layout packs float32 into float16"),
    ("prepack-layout", _set("payloads[0].prepack[0].layout", "q4"), P, "payloads[0].prepack[0].layout",
     "unknown layout 'q4'"),
    ("prepack-entry-list", _set("payloads[0].prepack[0]", [1, 2]), P, "payloads[0].prepack[0]", "expected a map"),
    # ------------------------------------------------------------- offload schedule
    ("offload-len", _set("payloads[0].offload.reads", [[2, 4]]), P, "payloads[0].offload.reads",
     "1 entries for 2 nodes"),
    ("offload-order", _set("payloads[0].offload.reads[0]", [4, 2]), P, "payloads[0].offload.reads[0]",
     "reads prepacked values [4, 2], but its args read [2, 4]"),
    ("offload-dup", _set("payloads[0].offload.reads[0]", [2, 2, 4]), P, "payloads[0].offload.reads[0]", "[2, 4]"),
    ("offload-missing", _set("payloads[0].offload.reads[0]", [2]), P, "payloads[0].offload.reads[0]", "[2, 4]"),
    ("offload-extra", _set("payloads[0].offload.reads[1]", [2]), P, "payloads[0].offload.reads[1]", "args read []"),
    ("offload-str-id", _set("payloads[0].offload.reads[0]", ["2", 4]), P, "payloads[0].offload.reads[0][0]",
     "expected an integer"),
    ("offload-list", _set("payloads[0].offload", []), P, "payloads[0].offload", "expected a map"),
    ("offload-field", _set("payloads[0].offload.cursor", 0), P, "payloads[0].offload", "unknown field 'cursor'"),
    # ------------------------------------------------------------- methods
    ("methods-list", _set("methods", []), P, "methods", "expected a map"),
    ("method-empty-name", _rename_method(""), P, "methods", "not a non-empty string"),
    ("method-bytes-name", _rename_method(b"fwd"), P, "methods", "not a non-empty string"),
    ("method-unknown-field", _set("methods.forward.prepack", []), P, "methods.forward", "unknown field 'prepack'"),
    ("method-odd-name", _do(_rename_method("my method"), _set("methods.my method.inputs", [99])), P,
     "methods['my method'].inputs[0]", "out of range"),
]


@pytest.mark.parametrize("mutate,etype,path,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_document(mutate, etype, path, words):
    doc = copy.deepcopy(DOC)
    replaced = mutate(doc)  # in place, or a whole new document
    if replaced is not None:
        doc = replaced
    with pytest.raises(PayloadError) as ei:
        gpudelegate.loads(file_bytes(doc, DATA))
    e = ei.value
    assert type(e) is etype, f"{type(e).__name__}: {e}"
    assert e.path == path, str(e)
    assert str(e).startswith(f"{path}: ") and words in e.detail, str(e)


def test_the_example_message_of_the_brief():
    doc = copy.deepcopy(DOC)
    _set("methods.decode.ops[1].args[1]", 999)(doc)
    with pytest.raises(PayloadError, match=re.escape("methods.decode.ops[1].args[1]: value 999 out of range (0..3)")):
        gpudelegate.loads(file_bytes(doc, DATA))


def test_cases_start_from_a_valid_document():
    prog = gpudelegate.loads(file_bytes(DOC, DATA))
    assert program_document(prog) == DOC


def test_data_segment_longer_than_the_constants():
    with pytest.raises(PayloadError) as ei:
        gpudelegate.loads(file_bytes(DOC, DATA + bytes(64)))
    assert ei.value.path == "constants" and "192 bytes but the constants end at 128" in str(ei.value)


def test_document_and_header_versions_must_agree(monkeypatch):
    monkeypatch.setattr(document, "SUPPORTED_VERSIONS", (1, 2))  # the checks read it there
    with pytest.raises(PayloadError) as ei:
        validate.program_from_document(copy.deepcopy(DOC), data_size=len(DATA), header_version=2)
    assert ei.value.path == "version" and "header's version 2" in str(ei.value)


def test_program_from_document_rejects_non_plain_python_objects():
    # Callers other than loads (e.g. a JSON loader) may pass tuples or other objects.
    doc = copy.deepcopy(DOC)
    doc["constants"][0]["shape"] = (5, 3)
    with pytest.raises(PayloadError) as ei:
        validate.program_from_document(doc, data_size=len(DATA), header_version=1)
    assert ei.value.path == "constants[0].shape"


def test_hostile_values_are_described_not_dumped():
    # A 1000-deep list cannot be repr()'d; the message must still be produced.
    doc = copy.deepcopy(DOC)
    doc["constants"][0]["shape"] = [_deep(900)]
    with pytest.raises(PayloadError) as ei:
        validate.program_from_document(doc, data_size=len(DATA), header_version=1)
    assert ei.value.path == "constants[0].shape[0]" and "a list of 1" in str(ei.value)


# ------------------------------------------------------------------ accepted variants

def test_fp16_prepack_absent_optional_and_in_place_update_are_accepted():
    b = ProgramBuilder()
    w = b.constant("float32", (5, 3), rand_floats(15, seed=4))
    p = b.payload()
    x = p.input("float32", (7, 3))
    wd = p.prepack(p.constant(w))
    w16 = p.prepack(p.constant(w), layout="fp16")
    y = p.op("linear", [x, wd, -1])  # absent optional bias
    p.output(y, p.op("relu", [w16]))
    p.schedule_offload()
    m = b.method("run")
    outs = m.delegate(p, [m.input("float32", (7, 3))])
    m.output(*outs)
    prog = gpudelegate.loads(b.build().to_bytes())
    pl = prog.payloads[0]
    assert [e.layout for e in pl.prepack] == ["identity", "fp16"]
    assert pl.values[pl.prepack[1].dst].dtype == "float16"
    assert pl.nodes[0].args == [0, 2, -1]
    assert pl.offload.reads == [[2], [4]]


def test_method_reading_a_constant_directly_and_payload_without_schedule():
    prog = gpudelegate.loads(sample_program().to_bytes())
    assert prog.payloads[1].offload is None
    d = prog.methods["decode"]
    assert d.values[d.nodes[1].args[1]].constant == 1


# ------------------------------------------------------------------ constant hashes

def test_verify_constant_hashes_on_a_program_being_built():
    prog = sample_program()
    validate.verify_constant_hashes(prog)  # blobs, no data segment
    key = prog.constants[1].key
    blob = bytearray(prog.blobs[key])
    blob[0] ^= 1
    prog.blobs[key] = blob
    with pytest.raises(PayloadError) as ei:
        validate.verify_constant_hashes(prog)
    assert ei.value.path == "constants[1]" and "corrupt data segment" in str(ei.value)


def test_nonzero_padding_inside_the_data_segment():
    data = bytearray(DATA)
    data[60] = 7  # between constants[0] (60 bytes) and constants[1] at 64
    with pytest.raises(PayloadError) as ei:
        gpudelegate.loads(file_bytes(DOC, bytes(data)))
    assert ei.value.path == "data" and "[60, 64)" in str(ei.value)
    data = bytearray(DATA)
    data[127] = 7  # after the last constant
    with pytest.raises(PayloadError) as ei:
        gpudelegate.loads(file_bytes(DOC, bytes(data)))
    assert ei.value.path == "data" and "[84, 128)" in str(ei.value)
