"""How a record's bits are computed, beyond the sampler settings: the manifest's `numerics`.

Two runs with the same teacher, prompts, seeds and settings still produce different bits when
any of these differ (measured with the removed `tests/bench/record_bits.py`; the list and
the reasons are in docs/cache-format.md). The manifest records them, and a resumed precompute
refuses to add records computed differently (`check_compatible`), so a cache never mixes them.
They are not part of the record key: the key names the work (prompt, seed, settings); these
name the arithmetic it was done with.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

CPU_ENV = ("MKL_CBWR", "ATEN_CPU_CAPABILITY")
"""Environment switches that change the CPU kernels' arithmetic (MKL's code path, ATen's SIMD
level); recorded as set ("" when unset)."""
CUDA_ENV = ("CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE")


def _version(package: str) -> str:
    """The installed version; "" for a source tree on the path without package metadata."""
    try:
        return version(package)
    except PackageNotFoundError:
        return ""


def record_numerics(*, batch_size: int, device: torch.device) -> dict[str, Any]:
    """The numerics block for records computed in batches of `batch_size` on `device`."""
    out: dict[str, Any] = {
        "batch_size": batch_size,
        "device": device.type,
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device.type == "cpu":
        out |= {
            "intra_op_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn": torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled,
            **{f"env.{k}": os.environ.get(k, "") for k in CPU_ENV},
        }
    elif device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        out |= {
            "gpu": torch.cuda.get_device_name(index),
            "gpu_capability": list(torch.cuda.get_device_capability(index)),
            "cuda": torch.version.cuda or "",
            "cudnn": torch.backends.cudnn.version() or 0,
            "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cuda_matmul_fp16_reduced_precision": (
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
            ),
            "cuda_matmul_bf16_reduced_precision": (
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
            ),
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            **{f"env.{k}": os.environ.get(k, "") for k in CUDA_ENV},
        }
    return out


def follow_recorded_threads(recorded: dict[str, Any], device: torch.device) -> str | None:
    """Run with the intra-op thread count a cache's records were computed with.

    A CPU record's bits depend on how many threads split each reduction, and torchrun starts
    every rank with OMP_NUM_THREADS=1 while a single process takes every core: without this a
    2-rank resume of a 1-process cache (the README's own sequence) would be refused although
    the same bits are one `torch.set_num_threads` away. Returns the note to print, or None
    when nothing changed. Every other numerics entry cannot be changed from inside the process
    (device, versions, math flags) and stays a refusal (`manifest.check_compatible`)."""
    want = recorded.get("intra_op_threads")
    have = torch.get_num_threads()
    if device.type != "cpu" or not isinstance(want, int) or want < 1 or want == have:
        return None
    torch.set_num_threads(want)
    return (
        f"precompute: {want} intra-op threads per process (was {have}), as the cache's records "
        "were computed, so new records match them bit for bit"
    )
