"""Tests of statebridge.kernels (a package so the test modules can share helpers.py)."""
