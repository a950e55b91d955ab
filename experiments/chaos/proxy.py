"""A TCP proxy that can cut every connection through it at once: the chaos run puts it
between rollout workers and the learner.

`cut()` resets every open connection (SO_LINGER 0, so both ends see RST, as a dropped NAT
entry or a crashed load balancer gives them). A connection arriving while the learner is down
is refused the same way. Threads, one pair per connection: the chaos run has a handful.
"""

from __future__ import annotations

import socket
import struct
import threading


def _reset(sock: socket.socket) -> None:
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
  except OSError:
    pass
  try:
    sock.close()
  except OSError:
    pass


class CuttingProxy:
  def __init__(self, backend_port: int, host: str = "127.0.0.1"):
    self.backend = (host, backend_port)
    self._listener = socket.create_server((host, 0))
    self.port = self._listener.getsockname()[1]
    self._lock = threading.Lock()
    self._pairs: list[tuple[socket.socket, socket.socket]] = []
    self._closed = False
    self.cuts = 0
    self.connections = 0
    threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

  def _accept(self):
    while not self._closed:
      try:
        client, _ = self._listener.accept()
      except OSError:
        return
      try:
        backend = socket.create_connection(self.backend, timeout=2.0)
        backend.settimeout(None)
      except OSError:  # the learner is down: refuse, the worker retries
        _reset(client)
        continue
      for s in (client, backend):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      with self._lock:
        self._pairs.append((client, backend))
        self.connections += 1
      for a, b in ((client, backend), (backend, client)):
        threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

  def _pump(self, src: socket.socket, dst: socket.socket):
    try:
      while True:
        data = src.recv(1 << 16)
        if not data:
          break
        dst.sendall(data)
    except OSError:
      pass
    self._drop(src, dst)

  def _drop(self, a, b):
    with self._lock:
      self._pairs = [p for p in self._pairs if a not in p and b not in p]
    for s in (a, b):
      try:
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      try:
        s.close()
      except OSError:
        pass

  def cut(self) -> int:
    """Resets every open connection; returns how many were cut."""
    with self._lock:
      pairs, self._pairs = self._pairs, []
    for a, b in pairs:
      _reset(a)
      _reset(b)
    if pairs:
      self.cuts += 1
    return len(pairs)

  def close(self):
    self._closed = True
    self._listener.close()
    self.cut()
