"""Definitions shared by the store and its clients.

`wire` holds the constants both sides of the RESP protocol agree on; the
gRPC service definitions (`*.proto`) of the control plane live beside it.
"""
