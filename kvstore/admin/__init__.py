"""Administration: what an operator configures and reads.

`config` (the node's one configuration dataclass, from flags or TOML), `live_config`
(CONFIG GET/SET on a running node), `redis_params` (Redis's own parameters, which CONFIG
SET stores and the node ignores), `acl` (users, passwords, command and key rules),
`info` (INFO in Redis's format), `metrics` (the Prometheus endpoint with INFO's
counters), `slowlog` (commands slower than the threshold).
"""
