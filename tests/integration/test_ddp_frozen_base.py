"""DDP over a model with frozen parameters (a LoRA student) starts every rank from rank 0's
trained tensors without broadcasting the frozen base (`parallel.wrap_ddp`): the broadcast was
a transient of the base's size per rank, the peak of a LoRA run (docs/benchmarks.md).

Two gloo processes on loopback, each giving its tensors rank-dependent values, so what crossed
from rank 0 and what stayed is visible."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from zygote import Zygote

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]

RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as td
from torch import nn
from wandistill.runtime.dist import DistInfo
from wandistill.train import parallel

rank, frozen = int(os.environ["RANK"]), sys.argv[1] == "frozen"
td.init_process_group("gloo", rank=rank, world_size=2)
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
model.register_buffer("table", torch.zeros(3))
with torch.no_grad():
    for i, p in enumerate(model.parameters()):
        p.fill_(10 * rank + i)
    model.table.fill_(rank)
if frozen:
    model[0].requires_grad_(False)
ddp = parallel.wrap_ddp(model, DistInfo(rank, 2, rank, torch.device("cpu"), "gloo"))
ddp(torch.full((1, 4), float(rank + 1))).sum().backward()
print(json.dumps({
    "base": model[0].weight[0, 0].item(),
    "head": model[1].weight[0, 0].item(),
    "table": model.table[0].item(),
    "head_grad": model[1].weight.grad[0].tolist(),
}))
td.barrier()  # both ranks done before either tears gloo down (as train's export does)
td.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(zygote: Zygote, mode: str) -> list[dict[str, float]]:
    """Two gloo ranks, each a fork of the session's zygote (tests/zygote.py)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [zygote.python, "-c", RANK_SCRIPT, mode],
            env=zygote.env({**env, "RANK": str(r), "LOCAL_RANK": str(r)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_a_frozen_base_stays_where_it_was_loaded_and_only_trained_tensors_cross(
    zygote: Zygote,
) -> None:
    r0, r1 = _two_ranks(zygote, "frozen")
    assert (r0["base"], r1["base"]) == (0.0, 10.0)  # not broadcast: each rank's own
    assert r0["head"] == r1["head"] == 2.0  # the trained head: rank 0's
    assert r0["table"] == r1["table"] == 0.0  # buffers: rank 0's, as DDP's own sync
    assert r0["head_grad"] == r1["head_grad"]  # gradients still all-reduced


def test_a_model_without_frozen_parameters_gets_ddps_own_broadcast(zygote: Zygote) -> None:
    r0, r1 = _two_ranks(zygote, "full")
    assert r0["base"] == r1["base"] == 0.0
    assert r0["head"] == r1["head"] == 2.0
    assert r0["head_grad"] == r1["head_grad"]
