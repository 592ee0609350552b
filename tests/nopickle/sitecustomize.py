"""Make every unpickling raise, for a whole process: "no pickle is ever loaded", enforced.

In-process tests monkeypatch `targets()` (restored after the test). Subprocesses get this folder
on PYTHONPATH with WANDISTILL_TEST_NO_PICKLE=1: Python imports this `sitecustomize` at start-up,
before any library has bound `pickle.Unpickler` to a name of its own (torch.distributed does).
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV = "WANDISTILL_TEST_NO_PICKLE"


class PickleForbidden(AssertionError):
    """Something tried to unpickle during a run that must never do so."""


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise PickleForbidden("an unpickling was attempted (pickle.load/loads/Unpickler, torch.load)")


class NoUnpickler:
    """Subclassable (libraries subclass pickle.Unpickler at import), never instantiable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse()


def pickle_targets() -> list[tuple[object, str, object]]:
    """(module, attribute, replacement) for every way to unpickle that the stdlib has."""
    import _pickle
    import pickle

    out: list[tuple[object, str, object]] = []
    for mod in (pickle, _pickle):
        out += [(mod, "load", _refuse), (mod, "loads", _refuse), (mod, "Unpickler", NoUnpickler)]
    out += [(pickle, "_load", _refuse), (pickle, "_loads", _refuse)]
    return [*out, (pickle, "_Unpickler", NoUnpickler)]


def torch_targets() -> list[tuple[object, str, object]]:
    """torch.load (its weights_only unpickler is its own, not pickle's)."""
    import torch
    import torch.serialization

    return [(torch, "load", _refuse), (torch.serialization, "load", _refuse)]


def targets() -> list[tuple[object, str, object]]:
    return [*pickle_targets(), *torch_targets()]


def _is_torchrun_launcher() -> bool:
    """torchrun's own launcher unpickles its rendezvous state (torch/distributed/elastic/
    rendezvous/dynamic_rendezvous.py); it runs no wandistill code. Its workers are guarded."""
    argv = getattr(sys, "orig_argv", [])
    return "torch.distributed.run" in argv[1:3] or os.path.basename(argv[0] if argv else "") in (
        "torchrun",
    )


if os.environ.get(ENV) == "1" and not _is_torchrun_launcher():
    for module, name, replacement in pickle_targets():  # first: torch binds them at import
        setattr(module, name, replacement)
    for module, name, replacement in torch_targets():
        setattr(module, name, replacement)
