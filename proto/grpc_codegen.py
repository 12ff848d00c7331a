"""Python gRPC stubs for proto/*.proto, generated on first import, never committed.

Generated code goes stale silently when a .proto changes, so it lives outside
the source tree: `load("conductor")` runs grpc_tools.protoc into a cache
folder (KVSTORE_PROTO_CACHE, else ~/.cache/kvstore/proto, in a subfolder per
grpcio-tools version) whenever the stubs are missing or older than their
.proto, then imports `<name>_pb2` and `<name>_pb2_grpc` from there. The stubs
refuse a grpcio older than the grpcio-tools that wrote them, so two
environments on one machine must not share them. A lock file keeps two processes that start at
once from writing the same files together.
"""
from __future__ import annotations

import fcntl
import importlib
from importlib import metadata
import os
import sys
from pathlib import Path
from types import ModuleType

PROTO_DIR = Path(__file__).resolve().parent


def cache_dir() -> Path:
    root = os.environ.get("KVSTORE_PROTO_CACHE") or Path.home() / ".cache" / "kvstore" / "proto"
    return Path(root) / f"grpcio-tools-{metadata.version('grpcio-tools')}"


def _stale(proto: Path, out: Path, name: str) -> bool:
    made = [out / f"{name}_pb2.py", out / f"{name}_pb2_grpc.py"]
    return any(not m.exists() or m.stat().st_mtime < proto.stat().st_mtime for m in made)


def _generate(proto: Path, out: Path) -> None:
    from grpc_tools import protoc
    import grpc_tools

    includes = Path(grpc_tools.__file__).resolve().parent / "_proto"
    code = protoc.main(["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{includes}",
                        f"--python_out={out}", f"--grpc_python_out={out}", str(proto)])
    if code != 0:
        raise RuntimeError(f"protoc failed on {proto.name} (exit {code})")


def load(name: str) -> tuple[ModuleType, ModuleType]:
    """The (messages, services) modules for proto/<name>.proto, generating them if needed."""
    proto = PROTO_DIR / f"{name}.proto"
    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _stale(proto, out, name):
            _generate(proto, out)
    if str(out) not in sys.path:
        sys.path.insert(0, str(out))
    return importlib.import_module(f"{name}_pb2"), importlib.import_module(f"{name}_pb2_grpc")
