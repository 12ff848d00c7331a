"""A throwaway certificate authority for TLS runs (the TLS tests and bench_tls).

`make_certificates(folder)` writes a CA, a node certificate valid for
127.0.0.1 and localhost, and a client certificate, all signed by that CA, with
the `openssl` command line (P-256 keys: quick to make, quick to handshake).
Nothing here is for production: the keys are unencrypted and live two days.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

DAYS = "2"
KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certificates:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def server_flags(self, auth_clients: str = "yes") -> list[str]:
        """`kvstore serve` (and redis-server) flags for a TLS listener with these files."""
        return ["--tls-cert-file", self.server_cert, "--tls-key-file", self.server_key,
                "--tls-ca-cert-file", self.ca, "--tls-auth-clients", auth_clients]


def make_certificates(folder: Path) -> Certificates:
    """Write the CA, the node's and a client's certificate and key into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    f = {name: str(folder / name) for name in ("ca.crt", "ca.key", "server.crt", "server.key",
                                               "client.crt", "client.key", "san.ext")}
    Path(f["san.ext"]).write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-x509", *KEY, "-keyout", f["ca.key"], "-out", f["ca.crt"], "-days", DAYS,
             "-subj", "/CN=kvstore throwaway CA")
    for who, extra in (("server", ["-extfile", f["san.ext"]]), ("client", [])):
        csr = str(folder / f"{who}.csr")
        _openssl("req", *KEY, "-keyout", f[f"{who}.key"], "-out", csr, "-subj", f"/CN=kvstore {who}")
        _openssl("x509", "-req", "-in", csr, "-CA", f["ca.crt"], "-CAkey", f["ca.key"], "-CAcreateserial",
                 "-out", f[f"{who}.crt"], "-days", DAYS, *extra)
    return Certificates(f["ca.crt"], f["server.crt"], f["server.key"], f["client.crt"], f["client.key"])


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)
