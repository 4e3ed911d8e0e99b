"""Two `aqua-export serve` replicas behind HAProxy, as docs/deploy/haproxy.cfg deploys them (tools/replicas.py at
tiny size): streamed chats through the proxy, one replica killed with SIGKILL under load and restarted on its port.
Every request the killed replica did not hold is answered, and the proxy sends the restarted one work again."""

import os
import random
import subprocess
from pathlib import Path

import pytest
from helpers import tiny_folder

from aqua_export.config import AquaConfig
from tools import replicas

ROOT = Path(__file__).resolve().parents[1]

if not replicas.HAPROXY.exists():
    pytest.skip(f"no {replicas.HAPROXY}: `make test` unpacks Debian's HAProxy there (plugins/fetch_deb.sh "
                f"{replicas.HAPROXY_DEBS} build/haproxy bookworm)", allow_module_level=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_llama):
    m, proj = tiny_llama
    cfg = AquaConfig(k_ratio=0.5)
    return tiny_folder(m, proj, cfg, tmp_path_factory.mktemp("replica"))


def test_a_replica_killed_under_load_loses_only_what_it_held_and_comes_back(folder, tmp_path):
    rnd = random.Random(0)
    prompts = ["".join(rnd.choice("abcdefgh ") for _ in range(rnd.randint(5, 25))) for _ in range(24)]
    # 300 tokens each: a few seconds a stream, so the kill cuts some short (short ones are sent whole at once)
    res = replicas.fault_run(folder, prompts, 300, 6, ["--threads", "1", "--context", "512", "--max-seqs", "2"],
                             tmp_path / "logs", kill_after=4)
    print(res)
    assert res["lost_elsewhere"] == 0, res  # the proxy sent everything else to the live replica
    assert res["answered"] == res["requests"] - res["lost_with_killed"], res
    assert min(res["by_replica"].values()) >= 1, res  # both served
    assert res["taken_back_s"] is not None and res["served_by_restarted"] >= 1, res



def test_the_documented_way_to_run_the_unpacked_haproxy_starts_it():
    """docs/reference.md's command line for the HAProxy `make haproxy` unpacks (its libraries are not on the loader's
    path: without LD_LIBRARY_PATH the binary does not start) checks docs/deploy/haproxy.cfg valid."""
    import shlex

    text = (ROOT / "docs" / "reference.md").read_text()
    line = next(ln.strip() for ln in text.splitlines() if "build/haproxy/usr/sbin/haproxy -f" in ln)
    words = shlex.split(line)
    env = dict(os.environ, AQUA_PROXY_BIND="127.0.0.1:18000", AQUA_REPLICA_1="127.0.0.1:18001",
               AQUA_REPLICA_2="127.0.0.1:18002")
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    r = subprocess.run([words[0], "-c", *words[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "valid" in r.stdout + r.stderr, r.stderr[-500:]
