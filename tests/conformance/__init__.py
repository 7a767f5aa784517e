"""Executor conformance: every executor against the float64 reference kernels, op by op.

``cases.py`` holds the cases (one-op and multi-op programs, fresh seeded random inputs),
``executors.py`` the registry of executors under test, ``test_conformance.py`` the test.
"""
