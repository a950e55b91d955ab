r"""The gateway under load (issue 59): N concurrent agents against `launch.gateway`'s stack on
the embedded engine, and the same requests given to the engine directly.

  .venv/bin/python -m experiments.benchmarks.gateway_load                  # 8, 32, 128 agents
  .venv/bin/python -m experiments.benchmarks.gateway_load --agents=8 --model=tiny-chat
  .venv/bin/python -m experiments.benchmarks.gateway_load --engine=vllm   # make vllm-tools

Each agent plays one episode: two streamed chat calls (`--max_tokens` each, temperature 1, its
own seeds; the second call continues the first with the reply and one more user turn), then
its reward. The agents run in a separate process (asyncio, aiohttp), so that their HTTP work
does not share the gateway's interpreter; the gateway runs as `launch.gateway` builds it (a
journal file with its fsyncs, the engine's own thread batching up to `--num_slots` calls;
with `--engine=vllm` a vLLM 0.32 CPU server started by `launch.vllm_server` on the exported
model, every call its own streamed request to it).

`direct` gives the engine exactly the requests the gateway gave it (their token ids, seeds and
limits, recorded on the way), in two waves of one `generate` each (every agent's first turn,
then every second turn), the best batching the engine can have. Its times come from the
engine's per-token callback: time to first token and latency from the wave's start.
`tokens_differ` counts the requests whose tokens differ from the gateway's: a request's
sampling does not depend on its batch, but its logits may by a rounding (another attention
window, a reused prefix), which can flip a near-tie.

JSON lines: one per path and agent count (requests/s, completion tokens/s, time to first
token and latency p50/p99, peak RSS of this process over the phase, CPU seconds of this
process and, for the gateway, of the agents' process, and the records the learner side
received beside the episodes rewarded), then the ratio of the gateway's wall time to the
direct one's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from absl import app, flags

from experiments.benchmarks.common import emitter, machine

F = flags.FLAGS
flags.DEFINE_list("agents", ["8", "32", "128"], "concurrent agents, one run each")
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry model")
flags.DEFINE_integer("max_tokens", 32, "max_tokens of each call")
flags.DEFINE_integer("num_slots", 32, "the engine's slots (and the gateway's batch)")
flags.DEFINE_enum("engine", "embedded", ["embedded", "vllm"], "the engine behind the gateway")
flags.DEFINE_integer("vllm_port", 31860, "the vLLM server's port (--engine=vllm)")
flags.DEFINE_integer("client_of", 0, "internal: run the agents against this port")
KEY = "bench-key"
emit = emitter("gateway_load")


# --- the agents (a separate process) ---

async def _agent(session, port: int, k: int, max_tokens: int) -> list[dict]:
  url = f"http://127.0.0.1:{port}"
  head = {"Authorization": f"Bearer {KEY}", "X-Episode-Id": f"agent-{k}"}
  msgs = [{"role": "user", "content": f"What is {k + 12} plus {3 * k + 7}? Answer briefly."}]
  out = []
  for turn in range(2):
    body = {"messages": msgs, "max_tokens": max_tokens, "temperature": 1.0,
            "seed": 1000 * k + turn, "stream": True}
    t0 = time.perf_counter()
    ttft, text = None, ""
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=head) as r:
      if r.status != 200:
        raise RuntimeError(f"agent {k}: {r.status} {await r.text()}")
      async for line in r.content:
        if not line.startswith(b"data: "):
          continue
        ttft = ttft or time.perf_counter() - t0
        if line.startswith(b"data: [DONE]"):
          break
        ev = json.loads(line[6:])
        if "error" in ev:
          raise RuntimeError(f"agent {k}: {ev['error']}")
        if ev["choices"] and ev["choices"][0]["delta"].get("content"):
          text += ev["choices"][0]["delta"]["content"]
    out.append({"ttft": ttft, "latency": time.perf_counter() - t0})
    msgs = msgs + [{"role": "assistant", "content": text},
                   {"role": "user", "content": "Are you sure?"}]
  async with session.post(f"{url}/v1/episodes/agent-{k}/reward", json={"reward": 1.0},
                          headers=head) as r:
    if r.status != 200:
      raise RuntimeError(f"agent {k}: reward {r.status} {await r.text()}")
  return out


async def _agents(port: int, n: int, max_tokens: int) -> None:
  import aiohttp
  conn = aiohttp.TCPConnector(limit=n)
  async with aiohttp.ClientSession(connector=conn,
                                   timeout=aiohttp.ClientTimeout(total=3600)) as s:
    t0 = time.perf_counter()
    calls = await asyncio.gather(*[_agent(s, port, k, max_tokens) for k in range(n)])
    print(json.dumps({"wall_s": time.perf_counter() - t0,
                      "calls": [c for a in calls for c in a]}), flush=True)


# --- the gateway's side (this process) ---

class _Sink:
  """The learner side, counting what it receives (the gateway's client interface)."""

  def __init__(self):
    self.records = 0

  def push(self, t, stop=None):
    self.records += 1
    return True, "admitted"

  def heartbeat(self, stats):
    return None

  def get_weights(self, v):
    return None


class _Peak:
  """Peak resident memory of this process while it runs (VmRSS every 50 ms)."""

  def __enter__(self):
    self.peak, self.stop = 0, threading.Event()
    self.t = threading.Thread(target=self._run, daemon=True)
    self.t.start()
    return self

  def _rss(self) -> int:
    with open("/proc/self/status") as f:
      return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS"))

  def _run(self):
    while not self.stop.is_set():
      self.peak = max(self.peak, self._rss())
      self.stop.wait(0.05)

  def __exit__(self, *exc):
    self.stop.set()
    self.t.join()
    self.peak = max(self.peak, self._rss())


class _Cpu:
  """CPU seconds (user + system) of this process and of its finished children over a
  phase: on a machine whose cores the agents share, what they took from the engine."""

  @staticmethod
  def _now():
    import resource
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime

  def __enter__(self):
    self.t0 = self._now()
    return self

  def __exit__(self, *exc):
    (s1, c1), (s0, c0) = self._now(), self.t0
    self.self_s, self.children_s = round(s1 - s0, 1), round(c1 - c0, 1)


def _stats(ttft, latency, wall, requests, tokens) -> dict:
  q = lambda x, p: round(float(np.percentile(x, p)), 4)  # noqa: E731
  return {"requests": requests, "wall_s": round(wall, 3),
          "requests_per_s": round(requests / wall, 3), "tokens_per_s": round(tokens / wall, 1),
          "ttft_p50_s": q(ttft, 50), "ttft_p99_s": q(ttft, 99),
          "latency_p50_s": q(latency, 50), "latency_p99_s": q(latency, 99)}


def _gateway_run(m, engine, n: int) -> tuple[dict, list]:
  from fr_jax.rollout.gateway import Gateway, GatewayConfig
  from fr_jax.rollout.openai_http import GatewayServer
  seen = []  # the requests the gateway gave the engine
  generate = engine.generate

  def recording(reqs, should_abort=None, more=None, done=None):
    asked = list(reqs)

    def pulled():
      got = list(more()) if more is not None else []
      asked.extend(got)
      return got

    def noted(c):
      seen.append((next(r for r in asked if r.request_id == c.request_id), c))
      if done is not None:
        done(c)

    if more is None and done is None:  # a server engine: one call per request
      out = generate(reqs, should_abort)
      seen.extend(zip(reqs, out))
      return out
    return generate(reqs, should_abort, more=pulled, done=noted)

  engine.generate = recording
  sink = _Sink()
  with tempfile.TemporaryDirectory() as d:
    gw = Gateway(engine, m.tokenizer, sink,
                 GatewayConfig(max_new_tokens=F.max_tokens, max_total_tokens=1024,
                               max_open_episodes=4 * n, weights=engine.weight_format),
                 journal=os.path.join(d, "gateway.db"), max_batch=F.num_slots,
                 engine_errors=engine.errors, serial_engine=engine.weight_format == "arrays",
                 follow_weights=False)
    server = GatewayServer(("127.0.0.1", 0), gw, KEY, max_connections=2 * n)
    server.serve_in_thread()
    try:
      with _Peak() as peak, _Cpu() as cpu:
        p = subprocess.run([sys.executable, "-m", "experiments.benchmarks.gateway_load",
                            f"--client_of={server.port}", f"--agents={n}",
                            f"--max_tokens={F.max_tokens}"],
                           capture_output=True, text=True, check=False)
        if p.returncode:
          raise RuntimeError(f"the agents failed: {p.stderr[-3000:]}")
        got = json.loads(p.stdout.strip().splitlines()[-1])
      t_end = time.monotonic() + 60
      while sink.records < gw.metrics().get("records", 0) and time.monotonic() < t_end:
        time.sleep(0.01)
      counters = gw.metrics()
    finally:
      server.shutdown()
      gw.close()
  engine.generate = generate
  calls = got["calls"]
  tokens = sum(len(c.token_ids) for _, c in seen)
  row = _stats([c["ttft"] for c in calls], [c["latency"] for c in calls], got["wall_s"],
               len(calls), tokens)
  row.update(cpu_s_this_process=cpu.self_s, cpu_s_agents=cpu.children_s,
             peak_rss_mb=round(peak.peak / 2**20),
             episodes_rewarded=counters["episodes_rewarded"], records_made=counters["records"],
             records_received=sink.records, segments_by_reason=counters["segments_by_reason"])
  return row, seen


def _direct_run(engine, seen: list) -> dict:
  """The gateway's requests, on the engine directly: every agent's first turn in one
  generate, then every second turn (first turns are those whose episode has no earlier
  request)."""
  import dataclasses
  first, second, times = [], [], {}
  episodes = set()
  for r, _ in seen:  # in the order the engine took them; an episode's first call comes first
    ep = r.request_id[r.request_id.index("agent-"):]  # PRODUCER-N-EPISODE
    (second if ep in episodes else first).append(r)
    episodes.add(ep)
  want = {r.request_id: c.token_ids for r, c in seen}
  ttft, latency, tokens, differ = [], [], 0, 0
  with _Peak() as peak, _Cpu() as cpu:
    t_start = time.perf_counter()
    for wave in (first, second):
      t0 = time.perf_counter()

      def note(rid, t0=t0):
        def on_token(tok, lp):
          times.setdefault(rid, []).append(time.perf_counter() - t0)
          return True
        return on_token

      reqs = [dataclasses.replace(r, on_token=note(r.request_id)) for r in wave]
      for r, c in zip(reqs, engine.generate(reqs)):
        differ += c.token_ids != want[r.request_id]
        ttft.append(times[r.request_id][0])
        latency.append(times[r.request_id][-1])
        tokens += len(c.token_ids)
    wall = time.perf_counter() - t_start
  row = _stats(ttft, latency, wall, len(seen), tokens)
  row.update(cpu_s_this_process=cpu.self_s, peak_rss_mb=round(peak.peak / 2**20),
             tokens_differ=differ)
  return row


def main(argv):
  del argv
  if F.client_of:
    asyncio.run(_agents(F.client_of, int(F.agents[0]), F.max_tokens))
    return
  from fr_jax.models import registry
  m = registry.load(F.model)
  proc = None
  if F.engine == "vllm":
    from fr_jax.rollout.vllm import VLLMEngine
    from launch import vllm_server
    work = "runs/bench_gateway_vllm"
    model_dir = vllm_server.export_model(F.model, work)
    log = os.path.join(work, "vllm.log")
    os.makedirs(work, exist_ok=True)
    proc = vllm_server.start(model_dir, port=F.vllm_port, api_key="bench", log=log)
    url = vllm_server.url_of("127.0.0.1", F.vllm_port)
    vllm_server.wait_ready(proc, url, log=log)
    engine = VLLMEngine(url, api_key="bench", max_concurrency=max(map(int, F.agents)))
  else:
    from fr_jax.rollout.embedded import EmbeddedEngine
    engine = EmbeddedEngine(m.config, m.params, tokenizer=m.tokenizer, num_slots=F.num_slots,
                            max_len=1024)
    engine.warmup()
  emit("machine", **machine(), model=F.model, engine=F.engine, max_tokens=F.max_tokens,
       num_slots=F.num_slots)
  try:
    _runs(m, engine)
  finally:
    if proc is not None:
      vllm_server.stop(proc)


def _runs(m, engine):
  from fr_jax.rollout.engine import Request
  # Warm: vLLM's first generate checks its log-probs; either engine's first request pays
  # start-up costs that are neither path's.
  engine.generate([Request("warm", m.tokenizer.encode("hi"), 4, temperature=1.0)])
  for n in map(int, F.agents):
    print(f"[gateway_load] {n} agents through the gateway", file=sys.stderr, flush=True)
    gw, seen = _gateway_run(m, engine, n)
    emit("gateway", engine=F.engine, agents=n, **gw)
    print(f"[gateway_load] {n} agents: the same requests on the engine directly",
          file=sys.stderr, flush=True)
    direct = _direct_run(engine, seen)
    emit("direct", engine=F.engine, agents=n, **direct)
    emit("ratio", engine=F.engine, agents=n,
         gateway_over_direct_wall=round(gw["wall_s"] / direct["wall_s"], 3),
         all_rewarded=gw["episodes_rewarded"] == n,
         records_received_equal_made=gw["records_received"] == gw["records_made"])


if __name__ == "__main__":
  app.run(main)
