"""The built-in KV connectors (see :mod:`pypto_serving.kv_transfer`)."""
