"""The fake cupy of tests/fakecuda, for CPU tests of the GPU tier and of the CUDA IPC path.

A test process gets a fresh copy for one test, under the name ``cupy``
(`fake_cupy`); a node started with `start_fake_gpu_node` imports it from its
PYTHONPATH, so its GPU tier keeps values in a memfd that the test's clients
map through the fake IPC handle, as a real client maps device memory.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from conftest import Daemon

FAKECUDA = Path(__file__).resolve().parent / "fakecuda"
REPO = FAKECUDA.parents[1]
NODE_BUS_ID = "0000:01:00.0"


def load_fake_cupy(devices: tuple[str, ...] = (NODE_BUS_ID,)):
    """A fresh fake cupy module (its own devices, streams, mappings and call log)."""
    spec = importlib.util.spec_from_file_location("cupy", FAKECUDA / "cupy" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.devices[:] = devices
    return module


@pytest.fixture
def fake_cupy(monkeypatch):
    """The fake cupy as ``import cupy`` sees it, for this test only."""
    module = load_fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def use_fake_cupy_in_children(monkeypatch, devices: str = NODE_BUS_ID) -> None:
    """Processes started from now on in this test import the fake as cupy (devices: PCI bus ids, in order)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKECUDA), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_CUDA_DEVICES", devices)


def start_fake_gpu_node(kvstore_factory, monkeypatch, *flags: str) -> Daemon:
    """`kvstore serve --gpu-size 16mb` whose cupy is the fake, started by ``kvstore_factory``."""
    use_fake_cupy_in_children(monkeypatch)
    return kvstore_factory("--gpu-size", "16mb", *flags)
