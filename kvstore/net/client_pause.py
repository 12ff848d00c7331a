"""CLIENT PAUSE / CLIENT UNPAUSE: hold clients' commands for a while, as Redis does.

An operator pauses clients to switch traffic safely (a failover, a
migration). While a pause is in force, dispatch defers every command
(``ALL``) or every write (``WRITE``) until it ends: at its deadline or at
CLIENT UNPAUSE. Nothing is refused and the order of each client's replies
is kept; the deferred commands run again from the start once the pause is
over. A second pause never shortens the first or makes it milder, as in
Redis: the later deadline and the stricter mode win.
"""
from __future__ import annotations

import asyncio


class ClientPause:
    """One pause in force: until when (loop time), and whether reads wait too."""

    def __init__(self, loop: asyncio.AbstractEventLoop, until: float, writes_only: bool):
        self.until, self.writes_only = until, writes_only
        self.over: asyncio.Future = loop.create_future()
        self._timer = loop.call_at(until, self.end)

    def holds(self, cmd) -> bool:
        """Whether ``cmd`` must wait for the pause to end."""
        return not self.writes_only or "write" in cmd.flags

    def end(self) -> None:
        """Release every client waiting on this pause."""
        self._timer.cancel()
        if not self.over.done():
            self.over.set_result(None)


def pause(server, ms: int, writes_only: bool) -> None:
    """CLIENT PAUSE: pause clients for ``ms`` milliseconds (merged with a pause in force)."""
    loop, old = server.loop, server.pause
    until = loop.time() + ms / 1000
    if old is not None:
        until, writes_only = max(until, old.until), writes_only and old.writes_only
    new = ClientPause(loop, until, writes_only)
    server.pause = new
    new.over.add_done_callback(lambda _: _forget(server, new))
    if old is not None:
        old.end()           # its clients run again and now wait on the new pause


def unpause(server) -> None:
    """CLIENT UNPAUSE: end the pause in force, if any."""
    if server.pause is not None:
        server.pause.end()


def _forget(server, ended: ClientPause) -> None:
    if server.pause is ended:
        server.pause = None
