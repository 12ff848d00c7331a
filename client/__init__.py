"""The kvstore client SDK: block keys, and a sync and an asyncio client.

    from client import KVClient, AsyncKVClient, KVClusterClient, BlockHasher

The clients speak RESP2 to a store node over TCP or a Unix socket with their
own zero-copy protocol code (`resp`), and never import the store's internals.
On the node's host, gets, puts, tensors and layer-wise blocks move through the
node's shared-memory arena (`fastpath`); both clients run every operation
through one sans-I/O core (`core`), their transports only do the I/O.
"""
from client.async_client import AsyncKVClient
from client.cluster import ClusterDown, KVClusterClient
from client.errors import (AuthenticationError, BufferTooSmall, ConnectionError, FastPathUnavailable, KVError,
                           LeaseExpired, ProtocolError, ResponseError, TimeoutError)
from client.hashing import BlockHasher, Namespace
from client.operations import Location
from client.put_pipeline import PutsFailed
from client.sync_client import KVClient
from client.tensors import TensorMismatch

__all__ = [
    "AsyncKVClient", "AuthenticationError", "BlockHasher", "BufferTooSmall", "ClusterDown", "ConnectionError",
    "FastPathUnavailable", "KVClient", "KVClusterClient", "KVError", "LeaseExpired", "Location", "Namespace", "ProtocolError",
    "PutsFailed", "ResponseError", "TensorMismatch", "TimeoutError",
]
