"""Single-key puts' chain links sent in the background (client/cluster_links.py).

`LinkSender` on a real thread pool, with stand-in node clients that record
each KV.LINK batch (no store process): a send that fails in any way loses its
links but never stops later ones to that node, and a closed sender sends
nothing more (no client is opened after its cluster client closed).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from client.cluster_links import LinkSender
from tests.conftest import wait_until

ADDR = "10.0.0.1:7000"


class Node:
    """A node client that records the links it is sent; ``failures`` sends raise first."""

    def __init__(self, failures: list[Exception] = ()):
        self.failures = list(failures)
        self.links: list[tuple] = []
        self.opened = 0

    def client_of(self, addr: str) -> "Node":
        self.opened += 1
        if self.failures:
            raise self.failures.pop(0)
        return self

    def batch_put(self, items, *, chain_links) -> list[bool]:
        self.links += chain_links
        return []


def idle(sender: LinkSender) -> bool:
    return not sender._sending


def test_a_send_that_fails_unexpectedly_loses_its_links_but_not_the_next_ones():
    node = Node(failures=[OSError("bad file descriptor")])
    with ThreadPoolExecutor(2) as pool:
        sender = LinkSender(pool, node.client_of)
        sender.add(ADDR, b"p1", b"c1")
        wait_until(lambda: idle(sender) and sender.lost == 1, what="the failed send to end")
        sender.add(ADDR, b"p2", b"c2")
        wait_until(lambda: node.links == [(b"p2", b"c2")], what="the next link to be sent")


def test_a_closed_sender_sends_nothing_more():
    node, entered, gate = Node(), threading.Event(), threading.Event()
    put = node.batch_put

    def slow_put(items, *, chain_links):
        entered.set()
        gate.wait(5.0)
        return put(items, chain_links=chain_links)
    node.batch_put = slow_put
    with ThreadPoolExecutor(2) as pool:
        sender = LinkSender(pool, node.client_of)
        sender.add(ADDR, b"p1", b"c1")
        assert entered.wait(5.0)                        # its send is under way ...
        sender.add(ADDR, b"p2", b"c2")                  # ... and this one waits behind it
        sender.close()
        sender.add(ADDR, b"p3", b"c3")
        gate.set()
        wait_until(lambda: idle(sender), what="the sender to stop")
    assert node.links == [(b"p1", b"c1")] and node.opened == 1 and sender.lost == 2
