"""What a connection remembers about its client beyond the socket: who it says it is, its
transaction, and the cluster flags that change how its next commands are routed.

`Connection` (connection.py) moves bytes: the socket, the request and reply buffers,
the backlog. The state that commands set and read lives here, one object per concern,
so CLIENT SETNAME touches only `ClientInfo`, MULTI/EXEC/WATCH only `Transaction`,
ASKING/READONLY only `RedirectFlags`, and CLIENT REPLY only `ReplyMode`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.commands.table import CommandError


def _printable(value: bytes) -> bool:
    return not any(c <= 32 or c > 126 for c in value)


@dataclass(slots=True)
class ClientInfo:
    """CLIENT SETNAME and CLIENT SETINFO: what CLIENT LIST and SLOWLOG show of the client."""

    name: bytes = b""
    lib_name: bytes = b""
    lib_ver: bytes = b""

    def set_name(self, name: bytes) -> None:
        if not _printable(name):
            raise CommandError("Client names cannot contain spaces, newlines or special characters.")
        self.name = name

    def set_lib_info(self, attr: bytes, value: bytes) -> None:
        if not _printable(value):
            raise CommandError(f"{attr.decode(errors='replace')} cannot contain spaces, newlines or special characters.")
        if attr.lower() == b"lib-name":
            self.lib_name = value
        elif attr.lower() == b"lib-ver":
            self.lib_ver = value
        else:
            raise CommandError(f"Unrecognized option '{attr.decode(errors='replace')}'")


@dataclass(slots=True)
class Transaction:
    """MULTI/EXEC and WATCH: the commands queued since MULTI and the keys watched (kvstore/store/watch.py)."""

    queued: list | None = None      # (args, has_extents) since MULTI; None outside a transaction
    aborted: bool = False           # a command was refused while queued: EXEC answers EXECABORT
    watched: dict[bytes, bool] = field(default_factory=dict)    # WATCHed key -> already expired then
    touched: bool = False           # a watched key was touched: EXEC answers null


@dataclass(slots=True)
class RedirectFlags:
    """Cluster flags of the connection: ASKING lets the next command run where an ASK sent it;
    READONLY lets reads be served by copies of hot blocks held here instead of MOVED."""

    asking: bool = False
    readonly: bool = False


@dataclass(slots=True)
class ReplyMode:
    """CLIENT REPLY ON|OFF|SKIP: whether the client's commands are answered. Under OFF or SKIP
    a command still runs, with its reply dropped (kvstore/commands/dispatch.py mutes it).
    ``muted`` is kept as a field, not computed, because dispatch asks it for every command."""

    off: bool = False               # CLIENT REPLY OFF: no replies until ON
    skip: bool = False              # CLIENT REPLY SKIP: no reply to the next command
    muting: bool = False            # a command runs now with its reply to be dropped
    muted: bool = False             # replies are being dropped: OFF, or a SKIP not used up yet

    def set(self, off: bool, skip: bool) -> None:
        self.off, self.skip, self.muted = off, skip, off or skip
