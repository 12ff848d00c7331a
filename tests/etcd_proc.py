"""Fixtures that start a real etcd (Debian's etcd-server) on free loopback ports.

Import the fixture into a test module (``from tests.etcd_proc import etcd``);
each test gets its own etcd with a temporary data directory, stopped and
removed afterwards. A test may `stop` and `start` it again (same ports, same data).
"""
from __future__ import annotations

import pytest

from kvstore.cluster.etcd_server import EtcdError, ThrowawayEtcd


@pytest.fixture
def etcd(tmp_path):
    try:
        server = ThrowawayEtcd(str(tmp_path / "etcd")).start()
    except EtcdError as e:
        pytest.fail(str(e))
    yield server
    server.close()
