"""Executor conformance: every executor against the float64 reference kernels, op by op.

``cases.py`` holds the cases (one-op and multi-op programs, fresh seeded random inputs),
``edges.py`` generates every op's edge samples from them (empty and 0-d tensors, broadcasting,
non-contiguous inputs, NaN/inf/-0.0, integer extremes), ``torch_ops.py`` spells every op in
PyTorch (the golden answers are held to it), ``executors.py`` the registry of executors under
test, ``test_conformance.py`` the test.
"""
