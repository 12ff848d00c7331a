"""WATCH: which connections watch which keys, and the signal that one was touched.

Redis's optimistic transactions: EXEC answers a null array when a key the
client watched was written, deleted, expired, evicted or flushed by anyone
(the client included) since WATCH. The signal comes from the engine's
listeners (commit, drop, in-place overwrite, new deadline; PERSIST, which
has none, calls `touched`), installed on the
first WATCH so a node whose clients never watch pays nothing per write.
A touched key's watchers are flagged and the key forgotten at once, so the
table only holds keys still worth watching; a closed connection's entries go
with it (weak references).
"""
from __future__ import annotations

from weakref import WeakKeyDictionary, WeakSet

from kvstore.store.deadlines import now_ms
from kvstore.store.engine import Engine

_BY_ENGINE: WeakKeyDictionary = WeakKeyDictionary()


class Watches:
    """Watched key -> the connections watching it, for one engine."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._watchers: dict[bytes, WeakSet] = {}
        engine.commit_listeners.append(lambda key, entry: self.touch(key))
        engine.drop_listeners.append(lambda entry, key: self.touch(key))
        engine.overwrite_listeners.append(self.touch)
        engine.expiry.listeners.append(self.touch)

    def touch(self, key: bytes) -> None:
        """``key`` changed: every transaction watching it will abort."""
        if self._watchers:
            for conn in self._watchers.pop(key, ()):
                conn.transaction.touched = True

    def watch(self, conn, key: bytes) -> None:
        """Watch ``key`` for ``conn``, noting whether it had already expired (as Redis does)."""
        if key in conn.transaction.watched:
            return
        deadline = self.engine.expiry.deadlines.get(key)
        conn.transaction.watched[key] = deadline is not None and deadline <= now_ms()
        self._watchers.setdefault(key, WeakSet()).add(conn)

    def unwatch(self, conn) -> None:
        """Forget every key ``conn`` watches (EXEC, DISCARD, UNWATCH)."""
        for key in conn.transaction.watched:
            conns = self._watchers.get(key)
            if conns is not None:
                conns.discard(conn)
                if not conns:
                    del self._watchers[key]
        conn.transaction.watched.clear()
        conn.transaction.touched = False

    def aborts(self, conn) -> bool:
        """Whether ``conn``'s EXEC must fail: a watched key was touched, or has expired
        since WATCH without anyone noticing yet."""
        if conn.transaction.touched:
            return True
        now, expires = now_ms(), self.engine.expiry.deadlines
        return any(not was_expired and expires.get(key, now + 1) <= now
                   for key, was_expired in conn.transaction.watched.items())


def watches_of(engine: Engine) -> Watches:
    """The engine's watch table, made (and its listeners installed) on first use."""
    watches = _BY_ENGINE.get(engine)
    if watches is None:
        watches = _BY_ENGINE[engine] = Watches(engine)
    return watches


def touched(engine: Engine, key: bytes) -> None:
    """A change the engine has no listener for (PERSIST removing a TTL) reaches the watchers."""
    watches = _BY_ENGINE.get(engine)
    if watches is not None:
        watches.touch(key)


def unwatch(conn) -> None:
    """Forget ``conn``'s watched keys, if it watches any."""
    if conn.transaction.watched:
        watches_of(conn.engine).unwatch(conn)
    conn.transaction.touched = False
