"""A model's weights as blocks of its HF tensors, each held by one learner process: what every
learner host serves and what a weight relay assembles into one safetensors file
(`fr_jax.transport.shards`).

A `Manifest` lists the HF tensors (sorted by name, as the file holds them), the dtype on the
wire (the servers' serving dtype) and the pieces: each piece is one block of one HF tensor
(`start`, `shape`) and the learner process (`host`) that serves it. A parameter sharded over
the mesh gives one piece per distinct shard and HF tensor (a stacked [L, in, out] matrix: one
per layer, transposed to HF's [out, in]); a block several processes hold (replicated over the
data axis) is served once, by the one of them with the fewest bytes so far, so the hosts
share the model evenly. Every process computes the same manifest from the global shardings
(`manifest_of`), and takes its own pieces from its addressable shards (`local_pieces`);
nothing is gathered.

The safetensors file a relay writes is laid out from the manifest alone (`header`,
`data_offsets`), so the relay writes each piece where it belongs as it arrives (`runs`).

A LoRA model is published unmerged: its base weights under their HF names and its adapters
under PEFT's (`hf_io.adapter_name`), with the scale alpha / r (`Manifest.lora_scale`). From
one version to the next only the adapters' pieces change, so a relay that holds the previous
version receives the adapters' bytes and an all-zero delta (a few bytes) for every base
piece; it folds the adapters into the file its server loads (`write_merged`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable

import numpy as np

from fr_jax.models import hf_io, lora
from fr_jax.models.config import ModelConfig

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# A relay's file of a LoRA version as fetched (base and adapters, a safetensors file under a
# name servers do not load), beside the merged model.safetensors (`write_merged`).
ADAPTED_FILE = "fetched-lora.safetensors.part"


class ManifestError(ValueError):
  """A manifest that does not describe a well-formed safetensors file."""


@dataclasses.dataclass(frozen=True)
class Piece:
  tensor: str  # HF name
  start: tuple[int, ...]  # of the block in the tensor
  shape: tuple[int, ...]  # of the block
  host: int  # the learner process that serves it


@dataclasses.dataclass(frozen=True)
class Manifest:
  dtype: str
  tensors: dict  # HF name -> shape, sorted by name
  pieces: tuple[Piece, ...]
  # A LoRA model's versions: its adapters travel beside the unchanged base weights, under
  # PEFT's names (`hf_io.adapter_name`), and a relay folds them in with this scale (alpha / r)
  # before its server loads the version (`write_merged`). 0: no adapters.
  lora_scale: float = 0.0

  @functools.cached_property
  def adapters(self) -> dict[str, tuple[str, str]]:
    """{adapter tensor: (the HF tensor it adapts, "a" or "b")}; empty without LoRA."""
    return {n: w for n in self.tensors if (w := hf_io.adapted_weight(n)) is not None}

  @property
  def served_tensors(self) -> dict:
    """{HF name: shape} of the model the servers load: the tensors less the adapters."""
    return {n: s for n, s in self.tensors.items() if n not in self.adapters}

  @property
  def itemsize(self) -> int:
    return hf_io._np_dtype(self.dtype).itemsize

  @property
  def nbytes(self) -> int:
    return sum(math.prod(s) for s in self.tensors.values()) * self.itemsize

  def piece_bytes(self, i: int) -> int:
    return math.prod(self.pieces[i].shape) * self.itemsize

  def to_json(self) -> str:
    return json.dumps({"dtype": self.dtype, "tensors": self.tensors,
                       "pieces": [[p.tensor, p.start, p.shape, p.host] for p in self.pieces],
                       "lora_scale": self.lora_scale})

  @classmethod
  def from_json(cls, text: str) -> Manifest:
    """The manifest, checked: a known dtype, integer shapes, and pieces that lie inside their
    tensors and add up to each tensor's size (ManifestError otherwise)."""
    try:
      d = json.loads(text)
      m = cls(str(d["dtype"]), {str(k): tuple(int(x) for x in v)
                                for k, v in sorted(d["tensors"].items())},
              tuple(Piece(str(t), tuple(int(x) for x in s), tuple(int(x) for x in sh), int(h))
                    for t, s, sh, h in d["pieces"]), float(d.get("lora_scale", 0.0)))
    except (ValueError, KeyError, TypeError) as e:
      raise ManifestError(f"unreadable manifest: {e}") from None
    m.check()
    return m

  def check(self) -> None:
    if self.dtype not in SAFETENSORS_DTYPES:
      raise ManifestError(f"dtype {self.dtype!r} is not one of {sorted(SAFETENSORS_DTYPES)}")
    covered = dict.fromkeys(self.tensors, 0)
    for p in self.pieces:
      shape = self.tensors.get(p.tensor)
      if shape is None or len(p.start) != len(shape) or len(p.shape) != len(shape) or any(
          s < 0 or n < 1 or s + n > d for s, n, d in zip(p.start, p.shape, shape)):
        raise ManifestError(f"piece {p} lies outside tensor {p.tensor!r} {shape}")
      covered[p.tensor] += math.prod(p.shape)
    short = [k for k, s in self.tensors.items() if covered[k] != math.prod(s)]
    if short:
      raise ManifestError(f"the pieces of {short[:3]} do not add up to the tensors")
    self._check_adapters()

  def _check_adapters(self) -> None:
    """Each adapter pairs an A [r, in] and a B [out, r] of one rank with a weight [out, in]
    of the manifest, and the scale is a positive number (ManifestError otherwise)."""
    if not self.adapters:
      return
    if not (math.isfinite(self.lora_scale) and self.lora_scale > 0):
      raise ManifestError(f"LoRA adapters with lora_scale {self.lora_scale}: not positive")
    ranks = set()
    for name, (weight, ab) in self.adapters.items():
      w = self.tensors.get(weight)
      other = hf_io.adapter_name(weight, "b" if ab == "a" else "a")
      shape = self.tensors[name]
      if w is None or len(w) != 2 or other not in self.tensors or len(shape) != 2 or (
          shape[1] != w[1] if ab == "a" else shape[0] != w[0]):
        raise ManifestError(f"adapter {name!r} {shape} does not fit a weight {weight!r} "
                            f"{w} with its other factor")
      ranks.add(shape[0] if ab == "a" else shape[1])
    if len(ranks) != 1:
      raise ManifestError(f"LoRA adapters of several ranks: {sorted(ranks)}")

  # --- the safetensors file ---
  @functools.cached_property
  def _offsets(self) -> dict[str, tuple[int, int]]:
    return self.data_offsets()

  def data_offsets(self) -> dict[str, tuple[int, int]]:
    out, at = {}, 0
    for name, shape in self.tensors.items():
      n = math.prod(shape) * self.itemsize
      out[name] = (at, at + n)
      at += n
    return out

  def header(self) -> bytes:
    """The file's first bytes: the little-endian u64 length, then the JSON header padded
    with spaces to a multiple of 8 (the safetensors format)."""
    st = SAFETENSORS_DTYPES[self.dtype]
    h = {name: {"dtype": st, "shape": list(self.tensors[name]), "data_offsets": list(o)}
         for name, o in self.data_offsets().items()}
    h["__metadata__"] = {"format": "pt"}
    raw = json.dumps(h, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw

  def runs(self, i: int, header_bytes: int | None = None) -> list[tuple[int, int, int]]:
    """Where piece i's bytes (C order) go in the file: [(file offset, offset in the piece,
    length)], one contiguous run per row of its block unless its rows are whole."""
    p, w = self.pieces[i], self.itemsize
    shape = self.tensors[p.tensor]
    base = (len(self.header()) if header_bytes is None else header_bytes) + \
        self._offsets[p.tensor][0]
    if not shape:
      return [(base, 0, w)]
    k = len(shape) - 1  # the last axis whose block is not whole, or 0
    while k > 0 and p.shape[k] == shape[k]:
      k -= 1
    run = math.prod(p.shape[k:]) * w
    strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
    out, at = [], 0
    for ix in np.ndindex(*p.shape[:k]):
      el = sum((p.start[j] + ix[j]) * strides[j] for j in range(k))
      el += sum(p.start[j] * strides[j] for j in range(k, len(shape)))
      out.append((base + el * w, at, run))
      at += run
    return out


def _owned_blocks(params, cfg: ModelConfig, host_of: Callable):
  """For each parameter (in `hf_leaves` order): (layout, array, [(start, shape, owner device
  or None)]), a block per distinct shard index. A block held by several hosts (replicated
  over the data axis) goes to the one of them with the fewest bytes so far, so every host
  serves about the same share; the same answer on every process."""
  load: dict = collections.Counter()
  out = []
  for layout, a in _leaves(params, cfg):
    sharding = getattr(a, "sharding", None)
    if sharding is None:
      out.append((layout, a, [((0,) * a.ndim, tuple(a.shape), None)]))
      continue
    holders: dict = collections.defaultdict(list)
    for d, index in sharding.devices_indices_map(tuple(a.shape)).items():
      key = tuple((s.start or 0, a.shape[j] if s.stop is None else s.stop)
                  for j, s in enumerate(index))
      holders[key].append(d)
    blocks = []
    for key, devs in sorted(holders.items()):
      shape = tuple(e - s for s, e in key)
      host = min({host_of(d) for d in devs}, key=lambda h: (load[h], h))
      load[host] += math.prod(shape)
      dev = min((d for d in devs if host_of(d) == host), key=lambda d: d.id)
      blocks.append((tuple(s for s, _ in key), shape, dev))
    out.append((layout, a, blocks))
  return out


def _leaves(params, cfg: ModelConfig):
  for path, layout in hf_io.hf_leaves(cfg, adapters=lora.has_adapters(params)).items():
    group, _, leaf = path.rpartition("/")
    yield layout, (params[group][leaf] if group else params[leaf])


def manifest_of(params, cfg: ModelConfig, dtype: str,
                host_of: Callable = lambda d: d.process_index) -> Manifest:
  """The manifest of `params` (device arrays, or NumPy on one host) in `dtype`; the same on
  every process. `host_of(device)` names the host serving a device's blocks."""
  if dtype not in SAFETENSORS_DTYPES:
    raise ManifestError(f"dtype {dtype!r} is not one of {sorted(SAFETENSORS_DTYPES)}")
  tensors, pieces = {}, []
  for layout, a, blocks in _owned_blocks(params, cfg, host_of):
    for name, _, block in hf_io.hf_blocks(layout, np.broadcast_to(np.uint8(0), a.shape)):
      tensors[name] = tuple(block.shape)
    for start, shape, dev in blocks:
      host = 0 if dev is None else host_of(dev)
      zeros = np.broadcast_to(np.uint8(0), shape)  # shapes only: no memory
      for name, hf_start, block in hf_io.hf_blocks(layout, zeros, start):
        pieces.append(Piece(name, tuple(hf_start), tuple(block.shape), host))
  tensors = dict(sorted(tensors.items()))
  order = {n: i for i, n in enumerate(tensors)}
  pieces.sort(key=lambda p: (order[p.tensor], p.start))
  m = Manifest(dtype, tensors, tuple(pieces),
               cfg.lora_scale if lora.has_adapters(params) else 0.0)
  m.check()
  return m


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """{HF name: shape} of the plain model `cfg` describes, adapters left out (no memory:
  shapes only)."""
  from fr_jax.models import decoder
  zeros = _zeros(decoder.param_shapes(cfg.replace(lora_rank=0)))
  return dict(manifest_of(zeros, cfg, cfg.param_dtype if cfg.param_dtype in SAFETENSORS_DTYPES
                          else "float32").tensors)


def _zeros(tree):
  if isinstance(tree, dict):
    return {k: _zeros(v) for k, v in tree.items()}
  return np.broadcast_to(np.uint8(0), tuple(tree))


def local_pieces(params, cfg: ModelConfig, manifest: Manifest, host: int,
                 host_of: Callable = lambda d: d.process_index) -> dict[int, np.ndarray]:
  """{piece index: contiguous NumPy block in the manifest's dtype} of the pieces `host`
  serves, from this process's addressable shards (or NumPy arrays)."""
  ids = {(p.tensor, p.start): i for i, p in enumerate(manifest.pieces) if p.host == host}
  dtype = hf_io._np_dtype(manifest.dtype)
  out = {}
  for layout, a, blocks in _owned_blocks(params, cfg, host_of):
    owned = {start: dev for start, _, dev in blocks}
    if getattr(a, "sharding", None) is None:
      sources = [((0,) * a.ndim, a)] if host == 0 else []
    else:
      sources = [(tuple(s.start or 0 for s in sh.index), sh.data) for sh in a.addressable_shards
                 if owned.get(tuple(s.start or 0 for s in sh.index)) == sh.device
                 and host_of(sh.device) == host]
    for start, data in sources:
      for name, hf_start, block in hf_io.hf_blocks(layout, data, start):
        i = ids.get((name, tuple(hf_start)))
        if i is not None:
          out[i] = np.ascontiguousarray(block.astype(dtype, copy=False))
  missing = sorted(set(ids.values()) - set(out))
  if missing:
    raise ManifestError(f"host {host} holds none of pieces {missing[:3]} its manifest names")
  return out


def write_merged(src, manifest: Manifest, dst) -> int:
  """Writes `dst`, the safetensors file a server loads, from `src`, the file a relay
  assembled from a LoRA model's `manifest` (its base weights and adapters): each adapted
  weight W [out, in] becomes W + scale B A (in float32, stored in the manifest's dtype), the
  adapters are left out, every other tensor is copied as it is. One tensor in memory at a
  time. Returns the bytes written."""
  dtype = hf_io._np_dtype(manifest.dtype)
  served = manifest.served_tensors
  out = Manifest(manifest.dtype, served,
                 tuple(Piece(n, (0,) * len(s), s, 0) for n, s in served.items()))
  data = np.memmap(src, np.uint8, "r")
  at, offsets = len(manifest.header()), manifest.data_offsets()

  def tensor(name):
    a, b = offsets[name]
    return data[at + a:at + b].view(dtype).reshape(manifest.tensors[name])

  factors = {(w, ab): n for n, (w, ab) in manifest.adapters.items()}
  header = out.header()
  with open(dst, "wb") as f:
    f.write(header)
    n = len(header)
    for name in served:
      w = tensor(name)
      if (name, "a") in factors:
        a, b = tensor(factors[(name, "a")]), tensor(factors[(name, "b")])
        delta = b.astype(np.float32) @ a.astype(np.float32)
        w = (w.astype(np.float32) + np.float32(manifest.lora_scale) * delta).astype(dtype)
      raw = np.ascontiguousarray(w).reshape(-1).view(np.uint8)
      f.write(raw)
      n += raw.size
    f.flush()
    os.fsync(f.fileno())
  return n


def write_peft(src, manifest: Manifest, dst_dir) -> int:
  """Writes the PEFT adapter directory of a LoRA version into `dst_dir` (adapter_model
  .safetensors with the manifest's adapters as they are, adapter_config.json with their rank,
  alpha = scale x rank and the modules they adapt), from `src`, the file a relay assembled
  from `manifest`: what an engine that loads adapters (vLLM's `/v1/load_lora_adapter`)
  takes instead of the merged model. Returns the bytes of the adapter file."""
  names = sorted(manifest.adapters)
  tensors = {n: manifest.tensors[n] for n in names}
  out = Manifest(manifest.dtype, tensors,
                 tuple(Piece(n, (0,) * len(s), s, 0) for n, s in tensors.items()))
  data = np.memmap(src, np.uint8, "r")
  at, offsets = len(manifest.header()), manifest.data_offsets()
  path = os.path.join(dst_dir, hf_io.PEFT_WEIGHTS)
  header = out.header()
  with open(path, "wb") as f:
    f.write(header)
    n = len(header)
    for name in names:
      a, b = offsets[name]
      f.write(data[at + a:at + b])
      n += b - a
    f.flush()
    os.fsync(f.fileno())
  rank = next(manifest.tensors[m][0] for m, (_, ab) in manifest.adapters.items() if ab == "a")
  modules = [w.removesuffix(".weight").rpartition(".")[2] for w, _ in manifest.adapters.values()]
  alpha = manifest.lora_scale * rank
  config = hf_io.peft_config(rank, int(alpha) if float(alpha).is_integer() else alpha, modules)
  with open(os.path.join(dst_dir, hf_io.PEFT_CONFIG), "w") as f:
    f.write(json.dumps(config, indent=2))
  return n
