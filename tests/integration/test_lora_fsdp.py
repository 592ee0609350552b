"""LoRA composes with FSDP2: adapters injected before `fully_shard` (each block, then the root)
get gradients, the frozen base none, and the `wandistill.student.lora` functions the sharded
train loop calls give the same keys, gathered to whole tensors for the LoRA file. 2 gloo ranks
under torchrun; the FSDP2 train loop itself is wandistill/train/parallel.py's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zygote import Zygote

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SCRIPT = """
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard

from wandistill.config import StudentLoraConfig
from wandistill.student import lora
from wandistill.teacher.tiny import TRANSFORMER_CONFIG
from diffusers import WanTransformer3DModel

dist.init_process_group("gloo")
out = Path(sys.argv[1])


def build():
    torch.manual_seed(0)
    m = WanTransformer3DModel(**TRANSFORMER_CONFIG)
    lora.add_lora(m, StudentLoraConfig(rank=4))
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(std=0.1)
    return m


plain, m = build(), build()
names = lora.trainable_names(m)
for block in m.blocks:
    fully_shard(block)
fully_shard(m)
x = torch.randn(2, 16, 1, 4, 4, generator=torch.Generator().manual_seed(1))
c = torch.randn(2, 5, TRANSFORMER_CONFIG["text_dim"], generator=torch.Generator().manual_seed(2))
t = torch.tensor([500.0, 300.0])
m(x, t, c, return_dict=False)[0].square().mean().backward()
plain(x, t, c, return_dict=False)[0].square().mean().backward()
grads = {n: p.grad for n, p in m.named_parameters()}
assert all(grads[n] is not None for n in names), "an adapter got no gradient"
assert all(g is None for n, g in grads.items() if n not in names), "the frozen base got one"
sharded = lora.trainable_state_dict(m)
assert list(sharded) == names and all(type(v).__name__ == "DTensor" for v in sharded.values())
full = lora.full_trainable_state_dict(m)  # a collective: every rank
ref = dict(plain.named_parameters())
for n in names:
    torch.testing.assert_close(full[n], ref[n].detach())
    torch.testing.assert_close(grads[n].full_tensor(), ref[n].grad, rtol=1e-5, atol=1e-6)
if dist.get_rank() == 0:
    path = lora.save_lora_folder(m, out, full)
    want = lora.adapter_state_dict(plain)
    got = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
dist.destroy_process_group()
"""


def test_lora_adapters_under_fully_shard_train_and_gather_like_the_unsharded_model(
    zygote: Zygote, tmp_path: Path
) -> None:
    script = tmp_path / "fsdp_lora.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = zygote.torchrun([str(script), str(tmp_path / "lora")], env=env)  # agent, ranks: forks
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
