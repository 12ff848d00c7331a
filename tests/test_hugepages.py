"""Huge pages on the DRAM arena: the host's shmem setting read, the advice given where it
allows them (node and SDK), and INFO saying which page size is in force."""
from __future__ import annotations

import mmap

import pytest

from client import KVClient
from kvstore.store.arena import Arena
from proto import hugepages


class Mapping:
    def __init__(self):
        self.advice = []

    def madvise(self, option, *args):
        self.advice.append(option)


def setting(tmp_path, monkeypatch, text: str) -> str:
    path = tmp_path / "shmem_enabled"
    path.write_text(text)
    monkeypatch.setattr(hugepages, "SHMEM_ENABLED", str(path))
    return str(path)


@pytest.mark.parametrize("text, mode, state", [
    ("always within_size [advise] never deny force\n", "advise", "advised"),
    ("always within_size advise [never] deny force\n", "never", "off"),
    ("[always] within_size advise never deny force\n", "always", "always"),
    ("always [within_size] advise never deny force\n", "within_size", "always"),
    ("always within_size advise never [deny] force\n", "deny", "off"),
])
def test_the_setting_decides_the_advice(tmp_path, monkeypatch, text, mode, state):
    setting(tmp_path, monkeypatch, text)
    assert hugepages.shmem_mode() == mode
    mapping = Mapping()
    assert hugepages.advise(mapping) == state
    assert mapping.advice == ([mmap.MADV_HUGEPAGE] if state != "off" else [])
    assert hugepages.page_size(state) == (2 << 20 if state != "off" else mmap.PAGESIZE)


def test_no_setting_file_means_no_advice(tmp_path, monkeypatch):
    monkeypatch.setattr(hugepages, "SHMEM_ENABLED", str(tmp_path / "absent"))
    mapping = Mapping()
    assert hugepages.shmem_mode() == "unknown" and hugepages.advise(mapping) == "off" and not mapping.advice


def test_the_node_arena_is_advised_when_the_setting_says_advise(tmp_path, monkeypatch):
    setting(tmp_path, monkeypatch, "always within_size [advise] never deny force\n")
    calls = []
    real = hugepages.advise
    monkeypatch.setattr(hugepages, "advise", lambda m, path=None: calls.append(m) or real(m, path))
    arena = Arena(4 << 20, prefault=True)
    try:
        assert calls and arena.hugepages == "advised" and arena.page_size == 2 << 20
    finally:
        arena.close()


def test_info_reports_the_arena_page_size(server):
    with KVClient(unix_socket=server.unix_socket) as kv:
        info = bytes(kv.execute("INFO", "kvcache")).decode()
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        expected = {"advise": "advised", "always": "always", "within_size": "always"}.get(hugepages.shmem_mode(), "off")
        assert fields["arena_hugepages"] == expected
        assert int(fields["arena_page_size"]) == hugepages.page_size(expected)


def test_the_sdk_advises_its_mapping_when_the_setting_says_advise(server, tmp_path, monkeypatch):
    setting(tmp_path, monkeypatch, "always within_size [advise] never deny force\n")
    with KVClient(unix_socket=server.unix_socket, fast_path="required") as kv:
        assert kv.put("k", b"v" * (1 << 20)) is True
        assert kv.fast_path.mapping.hugepages == "advised"
        assert kv.get("k") == b"v" * (1 << 20)
