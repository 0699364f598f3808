"""The transformers-made checkpoints and their reference tokens (shared with tests/models)."""

from tests.models.conftest import hf_models, one_cpu_thread, transformers_module  # noqa: F401
