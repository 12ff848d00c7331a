"""Wire constants shared by the store daemon and the client SDK.

Both sides import this module, so a command name or a default port is
spelled in exactly one place.
"""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 6380

# KV-cache command names (the store's command table and the SDK both use these).
KV_PUT = "KV.PUT"
KV_MATCH = "KV.MATCH"
KV_LOCATE = "KV.LOCATE"
KV_STATS = "KV.STATS"
KV_PIN = "KV.PIN"
KV_UNPIN = "KV.UNPIN"
KV_HOTKEYS = "KV.HOTKEYS"      # cluster: the hot blocks a node owns and where their copies are
KV_LINK = "KV.LINK"            # cluster: record that a block's chain continues on another node
KV_LINK_MAX = 1024             # (parent, child) pairs one KV.LINK may carry

# Tier names as they appear in KV.LOCATE, KV.STATS and INFO.
TIER_GPU = "gpu"
TIER_DRAM = "dram"
TIER_SSD = "ssd"
