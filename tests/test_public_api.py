"""The top-level package: its public names, a light import, and logging left to the application."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import statebridge
import statebridge.errors

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter on this source tree; it prints one JSON object."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), UCX_WARN_UNUSED_ENV_VARS="n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", statebridge.__all__)
def test_every_public_name_resolves(name):
    assert getattr(statebridge, name) is not None
    assert name in dir(statebridge)


def test_public_names_are_the_library_objects():
    from statebridge.node.client import Client
    from statebridge.state.spec import StateSpec

    assert statebridge.StateSpec is StateSpec
    assert statebridge.Client is Client
    for name in statebridge.errors.__all__:
        assert name in statebridge.__all__
        assert getattr(statebridge, name) is getattr(statebridge.errors, name)
    assert isinstance(statebridge.__version__, str) and statebridge.__version__
    with pytest.raises(AttributeError, match="no_such_name"):
        statebridge.no_such_name  # noqa: B018


def test_import_is_light_and_configures_no_logging():
    seen = run_python(
        "import json, logging, sys\n"
        "import statebridge\n"
        "heavy = [m for m in ('ucxx', 'torch') if m in sys.modules]\n"
        "root = [type(h).__name__ for h in logging.getLogger().handlers]\n"
        "statebridge.Client\n"
        "after_client = 'ucxx' in sys.modules\n"
        "print(json.dumps({'heavy': heavy, 'root': root, 'after_client': after_client}))\n")
    assert seen == {"heavy": [], "root": [], "after_client": False}


def test_package_logger_has_a_null_handler():
    handlers = logging.getLogger("statebridge").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers), handlers


def test_serving_modules_do_not_import_the_test_stand_ins():
    seen = run_python(
        "import json, sys\n"
        "import statebridge.cli, statebridge.connector.rank, statebridge.node.decode_node\n"
        "import statebridge.node.prefill_node, statebridge.node.rank_model\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('statebridge.testing'))))\n")
    assert seen == []
