"""Two `aqua-export serve` replicas behind HAProxy, as docs/deploy/haproxy.cfg deploys them (tools/replicas.py at
tiny size): streamed chats through the proxy, one replica killed with SIGKILL under load and restarted on its port.
Every request the killed replica did not hold is answered, and the proxy sends the restarted one work again."""

import random

import pytest
from helpers import char_tokenizer, folder_cfg

from aqua_export.config import AquaConfig
from aqua_export.export.exporter import export_onnx
from tools import replicas

if not replicas.HAPROXY.exists():
    pytest.skip(f"no {replicas.HAPROXY}: `make test` unpacks Debian's HAProxy there (plugins/fetch_deb.sh "
                f"{replicas.HAPROXY_DEBS} build/haproxy bookworm)", allow_module_level=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_llama):
    m, proj = tiny_llama
    cfg = AquaConfig(k_ratio=0.5)
    d = tmp_path_factory.mktemp("replica")
    export_onnx(m, proj, cfg, d / "model.onnx")
    char_tokenizer(d)
    folder_cfg(m, cfg).seal(d)
    return d


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

