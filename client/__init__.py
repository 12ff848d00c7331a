"""The kvstore client SDK: block keys, and a sync and an asyncio client.

    from client import KVClient, AsyncKVClient, BlockHasher

The clients speak RESP2 to a store node over TCP or a Unix socket with their
own zero-copy protocol code (`resp`), and never import the store's internals.
"""
from client.async_client import AsyncKVClient
from client.errors import (AuthenticationError, BufferTooSmall, ConnectionError, KVError,
                           ProtocolError, ResponseError, TimeoutError)
from client.hashing import BlockHasher, Namespace
from client.operations import Location
from client.sync_client import KVClient

__all__ = [
    "AsyncKVClient", "AuthenticationError", "BlockHasher", "BufferTooSmall", "ConnectionError",
    "KVClient", "KVError", "Location", "Namespace", "ProtocolError", "ResponseError", "TimeoutError",
]
