"""`make device-check DRY=1`: every section of the device check at toy sizes on the CPU, through
the Makefile line a user runs (the GPU run itself needs a GPU: BUILD.md). Also: the wheels the
check unpacks on the device import without pip, and are pinned as requirements.txt pins them."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from experiments.device_check import unpack_wheels

ROOT = Path(__file__).resolve().parents[1]


def pins(path):
  out = {}
  for line in (ROOT / path).read_text().splitlines():
    line = line.split("#")[0].strip()
    if "==" in line:
      name, version = line.split("==")
      out[name.lower().replace("_", "-")] = version
  return out


def test_dry_run_passes_every_section(tmp_path):
  r = subprocess.run(
      ["make", "-s", "device-check", "DRY=1",
       f"DEVICE_ARGS=--peer_fixtures={tmp_path / 'fixtures'} --wheels={tmp_path / 'none'}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
  assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
  kinds = {}
  for ln in lines:
    kinds.setdefault(ln["kind"], []).append(ln)
  assert kinds["summary"][0]["ok"] and kinds["summary"][0]["dry"]
  assert kinds["summary"][0]["results"] == dict.fromkeys(
      ["env", "fit", "peer", "attention", "learner", "engine"], True)
  # transformers' logits were written as fixtures, then fr_jax's compared against them
  assert sorted(p["model"] for p in kinds["peer"]) == ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
  assert all(p["ok"] and p["max_abs_err"] <= 1e-4 for p in kinds["peer"])
  assert all((tmp_path / "fixtures" / p["model"] / "peer.npz").is_file() for p in kinds["peer"])
  eq = {a["impl"]: a for a in kinds["attention_equal"]}
  assert set(eq) == {"flash", "pallas_gpu", "splash_tpu"}
  assert eq["pallas_gpu"]["interpret"] and eq["splash_tpu"]["interpret"]
  assert all(max(a["max_err_scaled"].values()) <= 1e-5 for a in eq.values())
  learner = {x["case"]: x for x in kinds["learner"]}
  assert set(learner) == {"fixed_8x256", "one_row_512"}
  assert learner["fixed_8x256"]["tokens"] == 8 * 255 and learner["one_row_512"]["tokens"] == 511
  assert all(x["tokens_per_s"] > 0 and x["compiles"] == 1 for x in learner.values())
  assert [e["generated"] for e in kinds["engine"]] == [2 * 8]
  # The fit section compiled compile_check's program for this device and ran it (the CPU
  # has no memory_stats: the ratio is the GPU's), for a dense recipe and an MoE one, and timed
  # its step (the roofline beside it is the GPU's too).
  fits = {f["recipe"]: f for f in kinds["fit"]}
  assert set(fits) == {"tiny_test", "tiny_moe"} and fits["tiny_moe"]["moe_impl"] == "auto"
  assert all(f["finite"] and f["predicted_peak_gib"] > 0 and f["step_s_median"] > 0
             for f in fits.values())


def test_the_device_wheels_are_pinned_as_the_runtime_is():
  device, runtime = pins("requirements-device.txt"), pins("requirements.txt")
  assert device and all(runtime.get(k) == v for k, v in device.items()), (device, runtime)


def test_unpacked_wheels_import_without_pip(tmp_path):
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  with zipfile.ZipFile(wheels / "fr_probe-1.0-py3-none-any.whl", "w") as z:
    z.writestr("fr_probe/__init__.py", "VALUE = 41 + 1\n")
    z.writestr("fr_probe-1.0.dist-info/METADATA", "Name: fr_probe\nVersion: 1.0\n")
  saved = list(sys.path)
  try:
    assert unpack_wheels(wheels, tmp_path / "site") == ["fr_probe-1.0-py3-none-any.whl"]
    import fr_probe
    assert fr_probe.VALUE == 42 and Path(fr_probe.__file__).is_relative_to(tmp_path / "site")
  finally:
    sys.path[:] = saved
    sys.modules.pop("fr_probe", None)
