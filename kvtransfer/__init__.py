"""Moving paged KV blocks from a prefill engine to a decode engine.

- layout.py    the shape of a paged KV block, and the handle that names a prompt's blocks
- transport.py the interface every transport implements, and the registry that picks one
- shm.py       same-host transport through files in /dev/shm
- connector.py our vLLM KV connector (KVConnectorBase_V1): the scheduler half decides which
               prompt tokens arrive from outside and into which blocks, the worker half moves them
- metrics.py   Prometheus metrics of the transfers, written from the engine process
"""

from kvtransfer.layout import KVHandle, KVLayout, LayoutMismatchError

__all__ = ["KVHandle", "KVLayout", "LayoutMismatchError"]
