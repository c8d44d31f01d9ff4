"""Test fixture: a self-signed certificate for 127.0.0.1, made with the `openssl` command."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest


def self_signed(folder: Path) -> tuple[Path, Path]:
    """(private key, certificate) PEM files in `folder`; skips the calling test without openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


def trusting(cert: Path) -> ssl.SSLContext:
    """A client context that trusts `cert` only."""
    return ssl.create_default_context(cafile=str(cert))
