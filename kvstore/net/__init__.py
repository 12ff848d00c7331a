"""The network front: sockets in, RESP frames, replies out.

`server` (listening sockets, accept loop, cron, shutdown; it builds the node's parts),
`connection` (one client: its buffers, backlog and reply path), `client_state` (what
commands set on a connection: client info, transaction, cluster flags), `protocol/` (the RESP
reader and writer), `tls` (the TLS listener), `client_pause` (CLIENT PAUSE's hold on
commands).
"""
