"""A throwaway CA and a server certificate for the TLS tests (openssl, always on a Debian host): the files
deploy/mosquitto/tls.conf expects under secrets/certs (ca.crt, server.crt, server.key)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def make_certs(folder: Path, server_name: str = "localhost", ip: str = "127.0.0.1") -> Path:
    """Writes folder/{ca.crt,ca.key,server.crt,server.key}; returns folder. The server certificate names
    `server_name` and `ip` (clients check the name they connect to)."""
    exe = shutil.which("openssl")
    if exe is None:
        raise FileNotFoundError("openssl is not installed")
    folder.mkdir(parents=True, exist_ok=True)

    def ssl(*args: str) -> None:
        subprocess.run([exe, *args], cwd=folder, check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=robobus test CA",
        "-keyout", "ca.key", "-out", "ca.crt")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={server_name}", "-keyout", "server.key",
        "-out", "server.csr")
    (folder / "san.ext").write_text(f"subjectAltName=DNS:{server_name},IP:{ip}\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "san.ext", "-out", "server.crt")
    (folder / "server.key").chmod(0o644)  # the broker (uid 1883 in its container) reads it; a test key only
    return folder
