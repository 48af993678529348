"""Throwaway certificates for the TLS tests, made at test time with the ``openssl`` command.

No key is ever committed: every test run makes a fresh CA, a server certificate (for
``localhost`` and 127.0.0.1), a client certificate per CN, and a second, unrelated CA with a
client of its own, in a directory the test owns. EC P-256 keys: fast to make.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Certs:
    ca: Path
    server: KeyPair
    # CN "device-1", signed by ``ca``.
    client: KeyPair
    # CN "intruder", signed by ``other_ca``, which the broker does not trust.
    other_ca: Path
    other_client: KeyPair

    def client_context(self, client: KeyPair | None = None) -> ssl.SSLContext:
        """A client context that trusts ``ca`` and presents ``client`` (if given)."""
        context = ssl.create_default_context(cafile=str(self.ca))
        if client is not None:
            context.load_cert_chain(str(client.cert), str(client.key))
        return context


def openssl(*args: str | Path, cwd: Path) -> None:
    result = subprocess.run(
        ["openssl", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(map(str, args))} failed:\n{result.stderr}")


def make_ca(directory: Path, name: str) -> KeyPair:
    pair = KeyPair(directory / f"{name}.pem", directory / f"{name}.key")
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", pair.key, "-out", pair.cert, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    return pair


def make_leaf(directory: Path, ca: KeyPair, name: str, cn: str, extensions: str) -> KeyPair:
    pair = KeyPair(directory / f"{name}.pem", directory / f"{name}.key")
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    ext.write_text(extensions)
    openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", pair.key, "-out", csr, "-subj", f"/CN={cn}",
        cwd=directory,
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial",
        "-out", pair.cert, "-days", "2", "-extfile", ext,
        cwd=directory,
    )  # fmt: skip
    return pair


def make_certs(directory: Path) -> Certs:
    """Makes every certificate in ``directory`` (created if missing)."""
    if shutil.which("openssl") is None:
        why = "the openssl command is not installed (apt-get install openssl)"
        if os.environ.get("FASTBROKER_REQUIRED") == "1":
            pytest.fail(why)
        pytest.skip(why)
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory, "ca")
    other_ca = make_ca(directory, "other-ca")
    leaf = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    server = make_leaf(
        directory,
        ca,
        "server",
        "localhost",
        leaf + "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    client = make_leaf(directory, ca, "client", "device-1", leaf + "extendedKeyUsage=clientAuth\n")
    other_client = make_leaf(
        directory, other_ca, "other-client", "intruder", leaf + "extendedKeyUsage=clientAuth\n"
    )
    return Certs(ca.cert, server, client, other_ca.cert, other_client)
