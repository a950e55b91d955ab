"""Throwaway TLS material for the transport tests, made with the `openssl` command line tool:
a CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by
the CA, plus a second CA whose client certificate the server must refuse."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _run(*args, cwd):
  subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str):
  _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
       f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str):
  (d / f"{name}.ext").write_text(ext)
  _run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
       f"{name}.key", "-out", f"{name}.csr", cwd=d)
  _run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
       "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


def make(d: Path) -> dict:
  """Writes the files into `d`; returns their paths by role."""
  d.mkdir(parents=True, exist_ok=True)
  _ca(d, "ca")
  _ca(d, "rogue_ca")
  _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "extendedKeyUsage=serverAuth\n")
  _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
  _leaf(d, "rogue", "rogue_ca", "extendedKeyUsage=clientAuth\n")
  return {k: str(d / v) for k, v in dict(
      ca="ca.pem", server_cert="server.pem", server_key="server.key",
      client_cert="client.pem", client_key="client.key",
      rogue_cert="rogue.pem", rogue_key="rogue.key").items()}
