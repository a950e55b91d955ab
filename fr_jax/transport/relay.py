"""The weight relay: brings each new weights version from the learner to one SGLang server,
without a shared filesystem (`launch/weight_relay.py` runs it beside each server).

One loop, one version at a time:

1. **Poll.** A heartbeat every `poll_s` (as worker `relay@<server>`, reporting the version its
   server holds): the learner's published version, and its shutdown flag, which ends the relay.
2. **Fetch.** `GetWeights(min_version=delivered+1)` over the learner's gRPC service, each
   tensor checked against the CRC-32 its last chunk carries (`codec.assemble_weights`). A
   damaged or cut stream (`checksum_mismatch`, `incomplete`, `stream_cut`, ...) is counted by
   its reason and fetched again after a backoff (0.2 s doubling to 5 s), up to
   `max_fetch_attempts` times before the poll loop (and its shutdown check) has its turn.
3. **Write.** HF safetensors (`hf_io.save_hf`) into a hidden temporary directory in `out_dir`,
   every file and the directory fsynced, then renamed to `vNNNNNNNN` and the parent fsynced.
   A version is visible only whole: a crash or kill mid-write leaves a hidden `.vNNNNNNNN.*`
   directory, which the next start removes; a write that fails (a full disk) leaves nothing
   and is tried again after the next poll. The last `keep` versions stay on disk.
4. **Load.** `load(path, version)` (the launcher passes the engine's `update_weights`; for
   SGLang: pause, `/update_weights_from_disk` with `weight_version`, continue). Before a
   version becomes visible, `prepare(dir)` finishes it for that server (the engine's
   `prepare_weights`: vLLM's needs the LM head untied). Retried after a backoff
   only while the server cannot be reached (`unreachable(error)` for an error of
   `load_errors`). A server that answers with a refusal (another model, a bad path, an HTTP
   error) is not asked again for that version (each try pauses it): the refusal is counted
   (`load_refused`), kept in `refused` with its message, and the relay waits for another
   version. Only a load that succeeds delivers the version.
5. **Check.** With `served` (the launcher passes `SGLangEngine.served_version`), each poll asks
   the server which version it holds; a server that restarted comes back with its launch
   weights, and the learner's version is delivered to it again (`server_reset`).

**Shards** (`fr_jax.transport.shards`). With a learner that serves them (the default of
`launch.learner`), steps 2 and 3 are one: `GetManifest` names the version, its pieces, the
learner hosts and a parent relay, and the pieces are written straight into the version's
safetensors file from the parent, then the hosts (in parallel), in the serving dtype, as
deltas against the version the relay holds where the learner still has it. The relay serves
the versions it holds to its peers (`serve`, through `launch.weight_relay --serve_address`).
A learner without shards (UNIMPLEMENTED) is followed as above.

The HF config comes from the run config's model (`weights_spec.model_spec`: its shapes, GGUF
metadata or config.json, never its weights), and every version received is checked against
it (`weights_spec`: one check, for whole weights and for a shards manifest); a mismatch
(`--config` names another model than the learner trains) stops the relay with RelayError.
The relay imports the model layer (for the HF export) but not rollout: the server is reached
through the `load` callable.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import jax

from fr_jax import durable
from fr_jax.models import decoder, hf_shards
from fr_jax.models.config import ModelConfig, to_hf_config
from fr_jax.models.hf_io import save_hf
from fr_jax.transport import codec, shard_fetch, weights_spec
from fr_jax.transport.weights_spec import RelayError, hf_major, model_spec

__all__ = ["Delivery", "Relay", "RelayError", "hf_major", "model_spec", "write_version",
           "versions_on_disk", "clean_partial", "peak_rss_mb"]

log = logging.getLogger("fr_jax.relay")


# --- versions on local disk (fr_jax.durable) ---
versions_on_disk, clean_partial = durable.versions_on_disk, durable.clean_partial


def write_version(root, version: int, params, cfg: ModelConfig,
                  tokenizer_files: dict | None = None, *, save=save_hf,
                  prepare: Callable[[Path], object] | None = None) -> Path:
  """Writes `params` as HF safetensors to `root/vNNNNNNNN`, whole or not at all
  (`durable.write_version`: a hidden temporary directory, fsynced, renamed); `prepare`, if
  given, finishes the directory for its server before the rename. A version already there
  (a learner that restarted from an older checkpoint publishes its numbers again) is
  replaced whole."""
  def fill(d):
    save(d, params, cfg, tokenizer_files=tokenizer_files)
    if prepare is not None:
      prepare(d)
  return durable.write_version(root, version, fill)


# --- the loop ---
@dataclasses.dataclass
class Delivery:
  version: int
  bytes: int
  fetch_s: float  # the successful fetch, checksums included
  write_s: float
  load_s: float
  attempts: int  # fetches it took (shards: sources used)
  path: str
  wire_bytes: int = 0  # received: less than `bytes` where pieces came as deltas

  def line(self, server: str) -> str:
    mb = self.bytes / 1e6
    wire = (f", {self.wire_bytes / 1e6:.1f} MB on the wire"
            if self.wire_bytes and self.wire_bytes != self.bytes else "")
    return (f"relay: v{self.version} fetched {mb:.0f} MB{wire} in {self.fetch_s:.1f} s "
            f"({mb / max(self.fetch_s, 1e-9):.0f} MB/s"
            f"{f', {self.attempts} attempts' if self.attempts > 1 else ''}), written in "
            f"{self.write_s:.1f} s, loaded by {server} in {self.load_s:.1f} s")


class Relay:
  """Follows the learner (a `client.WeightsClient`) for one server (`load`)."""

  def __init__(self, client, load: Callable[[str, int], None], out_dir, cfg: ModelConfig,
               tokenizer_files: dict | None = None, *, server: str = "the server",
               keep: int = 2, poll_s: float = 1.0, load_errors: tuple = (OSError,),
               unreachable: Callable[[BaseException], bool] = (
                   lambda e: isinstance(e, (ConnectionError, TimeoutError))),
               served: Callable[[], int | None] | None = None,
               backoff_min: float = 0.2, backoff_max: float = 5.0,
               fetch_timeout_s: float = 3600.0, max_fetch_attempts: int = 8,
               say: Callable[[str], None] = print, use_shards: bool | None = None,
               serve_address: str = "", streams: int = 1,
               prepare: Callable[[Path], object] | None = None, adapters: bool = False):
    if keep < 1:
      raise ValueError(f"keep={keep}: keep at least the version the server loaded")
    self.client, self.load, self.out_dir = client, load, Path(out_dir)
    self.cfg, self.tokenizer_files, self.server = cfg, tokenizer_files, server
    self.keep, self.poll_s, self.load_errors = keep, poll_s, load_errors
    self.unreachable, self.served = unreachable, served
    # What the configured model's parameters take (4 bytes each at most, as published): a
    # stream that claims more is refused before anything is allocated for it.
    self.max_bytes = 4 * sum(math.prod(s) for s in jax.tree.leaves(
        decoder.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))
    self.refused: dict[int, str] = {}  # version -> the server's refusal
    self.backoff_min, self.backoff_max = backoff_min, backoff_max
    self.fetch_timeout_s, self.say = fetch_timeout_s, say
    self.max_fetch_attempts = max_fetch_attempts
    self.delivered = -1  # the version the server holds (-1: none delivered yet)
    self.history: list[Delivery] = []
    self.failures: collections.Counter = collections.Counter()  # by reason
    self.use_shards = use_shards  # None: if the learner serves them
    self.serve_address = serve_address  # where peers reach this relay's `serve`
    self.streams = streams  # parallel streams per source (shards)
    # finishes each version directory for the server before it becomes visible (the
    # engine's `prepare_weights`: vLLM's untied head)
    self.prepare = prepare
    # a LoRA version goes to the server as a PEFT adapter directory, not a merged model (an
    # engine that loads adapters: vLLM's `loads_adapters`)
    self.adapters = adapters
    self.files: collections.OrderedDict = collections.OrderedDict()  # v -> VersionFile
    self._files_lock = threading.Lock()
    self.t_start = time.monotonic()
    for name in clean_partial(self.out_dir):
      log.warning("removed %s/%s, left by an interrupted write", self.out_dir, name)

  def _wait(self, backoff: float, stop: threading.Event) -> float:
    stop.wait(backoff)
    return min(backoff * 2, self.backoff_max)

  def fetch(self, min_version: int, stop: threading.Event):
    """(version, flat arrays, attempts, seconds of the good fetch), retried after a damaged
    or cut stream up to `max_fetch_attempts` times; None if the learner has nothing that new,
    is unreachable, or on stop (the poll loop then tries again)."""
    backoff, attempts = self.backoff_min, 0
    while not stop.is_set() and attempts < self.max_fetch_attempts:
      attempts += 1
      t0 = time.perf_counter()
      try:
        got = self.client.fetch_weights(min_version, timeout=self.fetch_timeout_s,
                                        max_bytes=self.max_bytes)
      except codec.WeightsError as e:
        self.failures[e.reason] += 1
        if stop.is_set() or e.reason == "unreachable":
          log.warning("relay: %s", e)
          return None
        log.warning("relay: fetch of version >= %d failed (%s); attempt %d in %.1f s",
                    min_version, e, attempts + 1, backoff)
        backoff = self._wait(backoff, stop)
        continue
      return None if got is None else (got[0], got[1], attempts, time.perf_counter() - t0)
    return None

  def deliver(self, min_version: int, stop: threading.Event) -> Delivery | None:
    """Fetches, writes and loads the learner's weights if their version >= min_version."""
    if self.use_shards is not False:
      try:
        return self.deliver_shards(min_version, stop)
      except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
          self.failures["unreachable"] += 1
          log.warning("relay: no manifest from %s: %s %s", self.client.address, e.code(),
                      e.details())
          return None
        log.info("relay: %s serves no shards; fetching whole weights", self.client.address)
        self.use_shards = False
    got = self.fetch(min_version, stop)
    if got is None:
      return None
    v, flat, attempts, fetch_s = got
    del got
    nbytes = sum(a.nbytes for a in flat.values())
    cfg = weights_spec.check_flat(self.cfg, flat)
    t0 = time.perf_counter()
    params = codec.unflatten(flat)
    del flat
    try:
      path = write_version(self.out_dir, v, weights_spec.hf_major(params), cfg,
                           self.tokenizer_files,
                           prepare=self.prepare)
    except OSError as e:  # a full disk, say: nothing visible was left; the next poll retries
      self.failures["write_failed"] += 1
      log.warning("relay: cannot write v%d under %s (%s); trying again after the next poll",
                  v, self.out_dir, e)
      return None
    write_s = time.perf_counter() - t0
    del params  # the server may need the memory to load
    return self._load(path, v, nbytes, fetch_s, write_s, attempts, stop)

  # --- shards ---
  def check_manifest(self, manifest: hf_shards.Manifest) -> ModelConfig:
    return weights_spec.check_manifest(self.cfg, manifest)

  def deliver_shards(self, min_version: int, stop: threading.Event) -> Delivery | None:
    """One version through shards (module doc): manifest, pieces into the file, load."""
    got = self.client.manifest(min_version, self.serve_address)
    if got is None:
      return None
    v, manifest_json, hosts, parent = got
    try:
      manifest = hf_shards.Manifest.from_json(manifest_json)
    except hf_shards.ManifestError as e:
      self.failures["bad_manifest"] += 1
      log.warning("relay: %s", e)
      return None
    cfg = self.check_manifest(manifest)
    with self._files_lock:
      base = self.files.get(self.delivered)
    if base is not None and base.manifest != manifest:
      base = None
    sources = ([shard_fetch.Source(f"relay {parent}", parent)] if parent else []) + \
        [shard_fetch.Source("hosts", hosts=tuple(hosts))]
    vf, stats = None, {}

    def fill(d: Path) -> None:
      nonlocal vf, stats
      # A LoRA version is fetched as its base and adapters (only the adapters change from
      # one version to the next: deltas move their bytes alone) and folded into the plain
      # model the server loads; the fetched file stays beside it, under a name no server
      # loads, for the peers this relay serves and the next version's deltas.
      lora_file = d / hf_shards.ADAPTED_FILE if manifest.adapters else None
      vf = shard_fetch.VersionFile(lora_file or d / "model.safetensors", manifest, v)
      with self._files_lock:
        replaced = self.files.pop(v, None)  # the same version again (a server reset)
        self.files[v] = vf
      if replaced is not None:
        replaced.close()
      stats = shard_fetch.fetch(vf, sources, self._open_stream, base=base, stop=stop,
                           streams=self.streams)
      if lora_file is not None and self.adapters:
        hf_shards.write_peft(lora_file, manifest, d)
        return
      if lora_file is not None:
        hf_shards.write_merged(lora_file, manifest, d / "model.safetensors")
      (d / "config.json").write_text(json.dumps(to_hf_config(cfg), indent=2))
      for name, text in (self.tokenizer_files or {}).items():
        (d / name).write_text(text)
      if self.prepare is not None:
        self.prepare(d)

    t0 = time.perf_counter()
    try:
      path = durable.write_version(self.out_dir, v, fill)
    except (OSError, codec.WeightsError) as e:
      reason = e.reason if isinstance(e, codec.WeightsError) else "write_failed"
      self.failures[reason] += 1
      for r, n in getattr(e, "failures", {}).items():  # each source's reason
        self.failures[r] += n
      if vf is not None:
        vf.failed.set()
        with self._files_lock:
          self.files.pop(v, None)
        vf.close()
      log.warning("relay: v%d not fetched and written (%s); trying again after the next "
                  "poll", v, e)
      return None
    for r, n in stats["failures"].items():
      self.failures[r] += n
    fetch_s = time.perf_counter() - t0
    with self._files_lock:
      while len(self.files) > max(self.keep, 2):
        self.files.popitem(last=False)[1].close()
    log.info("relay: v%d from %s (%s)", v, stats["sources"], dict(vf.received))
    return self._load(path, v, manifest.nbytes, fetch_s, 0.0, len(stats["sources"]), stop,
                      wire_bytes=sum(vf.received.values()))

  def _open_stream(self, address, version, pieces, base_version):
    return self.client.open_shards(address, version, pieces, base_version,
                                   timeout=self.fetch_timeout_s)

  def serve(self, request, context):
    """A peer's `GetShards`: the pieces of a version this relay holds or is fetching."""
    with self._files_lock:
      vf = self.files.get(request.version)
    if vf is None or vf.failed.is_set():
      context.abort(grpc.StatusCode.NOT_FOUND, f"this relay does not hold v{request.version}")
    yield from vf.serve(request, context)

  def _load(self, path, v: int, nbytes: int, fetch_s: float, write_s: float, attempts: int,
            stop: threading.Event, wire_bytes: int | None = None) -> Delivery | None:
    backoff = self.backoff_min
    while True:  # a load once begun is not abandoned: the server must not stay paused
      if stop.is_set():
        return None
      t0 = time.perf_counter()
      try:
        self.load(str(path), v)
        break
      except self.load_errors as e:
        if not self.unreachable(e):  # an answer: asking again would pause it again
          self.failures["load_refused"] += 1
          self.refused[v] = str(e)
          log.error("relay: %s refused v%d: %s; not retried (waiting for another version)",
                    self.server, v, e)
          return None
        self.failures["load_unreachable"] += 1
        log.warning("relay: %s unreachable while loading v%d (%s); again in %.1f s",
                    self.server, v, e, backoff)
        backoff = self._wait(backoff, stop)
    d = Delivery(v, nbytes, fetch_s, write_s, time.perf_counter() - t0, attempts, str(path),
                 nbytes if wire_bytes is None else wire_bytes)
    previous, self.delivered = self.delivered, v
    self.history.append(d)
    durable.prune(self.out_dir, v, self.keep, also=previous if self.keep > 1 else None)
    self.say(d.line(self.server))
    return d

  def _check_served(self) -> None:
    """A server that restarted holds its launch weights, not what was delivered: then the
    learner's version is delivered again (counted as `server_reset`)."""
    if self.served is None or self.delivered < 0:
      return
    try:
      v = self.served()
    except self.load_errors as e:  # down right now: the next poll asks again
      log.debug("relay: %s did not say its version (%s)", self.server, e)
      return
    if v != self.delivered:
      self.failures["server_reset"] += 1
      log.warning("relay: %s holds version %s, not v%d (it restarted?); loading the "
                  "learner's version again", self.server, v, self.delivered)
      self.delivered = -1

  def stats(self) -> dict:
    return dict(engine_version=self.delivered, trajectories=0, tokens=0,
                uptime_s=time.monotonic() - self.t_start, inflight=0)

  def run(self, stop: threading.Event, max_versions: int = 0) -> str:
    """Polls and delivers until the learner shuts down ("shutdown"), `stop` is set
    ("stopped") or `max_versions` versions were delivered ("max_versions")."""
    unreachable_since = None
    while not stop.is_set():
      hb = self.client.heartbeat(self.stats())
      if hb is None:
        if unreachable_since is None:
          unreachable_since = time.monotonic()
          log.warning("relay: learner %s unreachable; polling every %.1f s",
                      self.client.address, self.poll_s)
        self.failures["heartbeat_unreachable"] += 1
      else:
        unreachable_since = None
        if hb["shutdown"]:
          return "shutdown"
        self._check_served()
        want = hb["version"]
        if want >= 0 and want != self.delivered and want not in self.refused:
          # newer: anything from delivered+1 on; older (the learner restarted from an older
          # checkpoint): its current weights
          d = self.deliver(want if want < self.delivered else self.delivered + 1, stop)
          if d is not None:
            if max_versions and len(self.history) >= max_versions:
              return "max_versions"
            continue  # poll again at once: another version may have come meanwhile
      stop.wait(self.poll_s)
    return "stopped"

  def summary(self, stopped: str) -> dict:
    return {"relay": self.server, "stopped": stopped, "delivered": self.delivered,
            "versions": [dataclasses.asdict(d) for d in self.history],
            "failures": dict(self.failures), "on_disk": versions_on_disk(self.out_dir),
            "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
  """This process's peak resident memory (VmHWM; ru_maxrss would count the parent's memory
  at the fork that started this process)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return float("nan")
