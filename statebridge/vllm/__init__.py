"""statebridge as a vLLM v1 KV connector (the only package that imports vLLM).

Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "StatebridgeConnector",
                           "kv_connector_module_path": "statebridge.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both"}'

``import statebridge`` never imports this package; importing it needs vLLM.
"""

from statebridge.vllm.connector import StatebridgeConnector

__all__ = ["StatebridgeConnector"]
