"""statebridge as a vLLM v1 KV connector (the only package that imports vLLM).

Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "StatebridgeConnector",
                           "kv_connector_module_path": "statebridge.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both"}'

``import statebridge`` never imports this package. ``StatebridgeConnector`` is imported on
first access (vLLM's loader does ``getattr(module, name)``), so the vLLM-free parts
(:mod:`statebridge.vllm.agent`, :mod:`statebridge.vllm.wire`) import without vLLM.
"""

__all__ = ["StatebridgeConnector"]


def __getattr__(name: str):
    if name == "StatebridgeConnector":
        from statebridge.vllm.connector import StatebridgeConnector

        return StatebridgeConnector
    raise AttributeError(f"module 'statebridge.vllm' has no attribute {name!r}")
