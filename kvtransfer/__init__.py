"""Moving paged KV blocks from a prefill engine to a decode engine.

- layout.py    the shape of a paged KV block, and the handle that names a prompt's blocks
- transport.py the interface every transport implements, and the registry that picks one
- shm.py       same host, CPU: the producer's KV cache lives in /dev/shm; the consumer copies
               blocks straight out of it (one copy), under a lease file
- tcp.py       any two hosts: staged blocks streamed over a socket into the consumer's blocks
- nccl.py      point-to-point through a private 2-rank torch.distributed group (gloo on CPU)
- cuda_ipc.py  same host, GPU: CUDA IPC handles of the staged blocks (untested without a GPU)
- staging.py, served.py, wire.py  what the network transports share: staged blocks under
               leases, the producer's control server, and its framed messages
- bench.py     `pdserve bench kv`: every transport against memcpy
- connector.py our vLLM KV connector (KVConnectorBase_V1): the scheduler half decides which
               prompt tokens arrive from outside and into which blocks, the worker half moves them
- metrics.py   Prometheus metrics of the transfers, written from the engine process
"""

from kvtransfer.layout import KVHandle, KVLayout, LayoutMismatchError

__all__ = ["KVHandle", "KVLayout", "LayoutMismatchError"]
