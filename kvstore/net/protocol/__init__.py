"""The RESP frame layer: `reader` parses requests, `writer` encodes replies.

Neither knows about sockets or commands; the connection feeds the reader and
sends what the writer builds.
"""
