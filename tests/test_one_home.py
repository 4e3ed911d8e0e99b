"""A mode's declaration is all the Python it needs outside its op: a tiny mode declared here (a flag, a default, a
node attribute, a capability row and its refusal, a parity probe) reaches the CLI, aqua_config.json, the node's
attributes, the capability table and docs/cli.md, AquaConfig's alias and is_dense, and parity's gates, recorded
choices, prompt length and refusal, with no file of the package edited. Run in a
fresh interpreter: the mode registers before AquaConfig and the table derive their fields."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = r'''
import json, sys
from aqua_export import settings
from aqua_export.settings.base import Mechanism, Probe, Setting

LEVEL = Setting("demo_level", int, 0, "demo: how hard the demo mode works (0 = off)", whole=(0, 3))
on = lambda cfg: cfg.demo_level > 0
settings.register(Mechanism(
    "demo", "a demo mode", (LEVEL,), on=on, node_attrs=lambda cfg: {"demo_level": cfg.demo_level} if on(cfg) else {},
    name_parts=lambda cfg: [f"demo{cfg.demo_level}"] if on(cfg) else [], aliases={"demos": on},
    features={"demo": on}, neutral={"demo_level": 0},
    refusals={("demo", "tensorrt"): "the demo mode has no TensorRT plugin: drop --demo-level"},
    probe=Probe("demo_rows", "demo near-ties", "demo_out", prompt=lambda cfg, n, limit: max(n, min(100, limit)),
                unexercised=lambda cfg, n, ctx: None if n >= 100 else
                f"the demo mode needs 100 prompt tokens, not {n}")))

from aqua_export import capabilities, cli
from aqua_export.capabilities import Features
from aqua_export.config import AquaConfig, ConfigError
from tools.cli_reference import reference

out = {}
args = cli.build_arg_parser().parse_args(["--model", "llama", "--demo-level", "2"])  # the main job's
cfg = AquaConfig(**settings.from_args(args))
out["flag"] = args.demo_level
out["json"] = json.loads(cfg.to_json()).get("demo_level")
out["round_trip"] = AquaConfig.from_json(cfg.to_json()) == cfg
out["attrs"] = settings.node_attrs(cfg).get("demo_level")
out["name"] = settings.name_parts(cfg)
out["alias"], out["dense"] = cfg.demos, cfg.is_dense
out["features"] = Features.of_config(cfg).demo
try:
    capabilities.check(Features.of_config(cfg), "tensorrt")
except ConfigError as e:
    out["refused"] = str(e)
out["runs_native"] = capabilities.refusal(Features.of_config(cfg), "native") is None
try:
    AquaConfig(demo_level=7)
except ConfigError as e:
    out["range"] = str(e)
doc = reference()
out["doc_flag"] = "`--demo-level`" in doc
out["doc_rows"] = [line for line in doc.splitlines() if line.startswith("| demo |")]  # settings', capabilities'
out["doc_refusal"] = "- demo on tensorrt: the demo mode has no TensorRT plugin: drop --demo-level" in doc
from aqua_export.parity import gates, harness
out["gate"] = gates.GATES.get("demo_rows")
out["prompt"] = [harness.prompt_length(cfg, 16, 4, None), harness.prompt_length(AquaConfig(), 16, 4, None)]
out["split"] = harness._split_selections([["coords", "demo"]], ["TopK_idx__0", "demo_out__1"])
try:
    harness.check_run(cfg, 16, 4, 64)
except ConfigError as e:
    out["parity_refused"] = str(e)
print(json.dumps(out))
'''


def test_a_mode_declared_in_one_place_reaches_every_derived_surface():
    r = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["flag"] == 2 and got["json"] == 2 and got["round_trip"]
    assert got["attrs"] == 2 and got["name"] == ["demo2"]
    assert got["alias"] is True and got["dense"] is False and got["features"] is True
    assert got["refused"] == "the demo mode has no TensorRT plugin: drop --demo-level" and got["runs_native"]
    assert got["range"] == "demo_level=7 is out of range: use a whole number in [0, 3]"
    assert got["doc_flag"] and got["doc_refusal"]
    settings_row, capability_row = got["doc_rows"]
    assert "`--demo-level`" in settings_row and "whole number in [0, 3]" in settings_row
    assert capability_row.count("| yes") == 6 and "| refused |" in capability_row  # tensorrt's column only
    assert got["gate"] == "demo near-ties" and got["prompt"] == [100, 16]
    assert got["split"]["coordinates"] == [["coords"]] and got["split"]["demo_rows"] == [["demo"]]
    assert got["parity_refused"] == "the demo mode needs 100 prompt tokens, not 60"


def test_register_after_the_config_exists_is_refused():
    program = ("from aqua_export import settings, config\nfrom aqua_export.settings.base import Mechanism\n"
               "settings.register(Mechanism('late', 'too late', (), on=lambda cfg: False))")
    r = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "settings.register after aqua_export.config was imported" in r.stderr
