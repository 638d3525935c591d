"""Several nodes (issue 41, item 6): two torchrun "nodes" on this machine (``--nnodes 2``, a rendezvous on
127.0.0.1), one CPU process each, train as the one-node launch of two processes does, bitwise, write their
checkpoint into the shared directory, and resume from it bitwise."""

from __future__ import annotations

from typing import Any

import pytest

from torchrun_util import torchrun, torchrun_nodes

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    root = tmp_path_factory.mktemp("nodes")
    results = {
        "one_node": torchrun("fsdp_fit.py", root / "one_node", "ddp", "-"),
        "two_nodes": torchrun_nodes("fsdp_fit.py", root / "two_nodes", "ddp", "-"),
    }
    middle = next(p for p in results["two_nodes"][0]["checkpoints"] if p.endswith("step-00000008"))
    results["resumed"] = torchrun_nodes("fsdp_fit.py", root / "resumed", "ddp", middle)
    return results


def test_two_nodes_train_as_one_node_of_two_processes(runs):
    one, two = runs["one_node"], runs["two_nodes"]
    assert [r["rank"] for r in two] == [0, 1]
    assert [r["distributed_type"] for r in two] == ["MULTI_CPU"] * 2
    assert two[0]["params"] == two[1]["params"] == one[0]["params"]  # the same samples, in the same steps
    assert two[0]["history"] == one[0]["history"]


def test_a_checkpoint_of_two_nodes_resumes_bitwise(runs):
    two, resumed = runs["two_nodes"], runs["resumed"]
    assert resumed[0]["params"] == two[0]["params"]
    assert resumed[0]["history"] == [h for h in two[0]["history"] if h["step"] > 8]
