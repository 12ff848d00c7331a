"""kvstore: a KV-cache store daemon for LLM serving that speaks the Redis protocol.

`kvstore serve` runs a node; see README.md for the layout of this package.
"""

__version__ = "0.1.0"
