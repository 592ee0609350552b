"""Distributed setup in one place: torchrun environment -> process group -> DistInfo.

Both stages use it: precompute to split prompts and gather shard commits, train for DDP. Model and
cache code never import torch.distributed. Collectives that carry Python objects go through JSON
bytes in uint8 tensors, never `*_object` collectives (those pickle).

Every rank exits; none waits forever:
- a rank that raises exits non-zero straight away (no barrier on the error path); torchrun then
  stops every other worker;
- joining has a deadline: every rank registers in the rendezvous store and waits at most the
  timeout for the others, then exits naming the ranks that never arrived (a rank whose store
  host, rank 0, never comes up says so too);
- every collective has the same timeout (`WANDISTILL_DIST_TIMEOUT`, or the recipe's
  `dist_timeout`, default 300 s: minutes, not torch's half hour); when one fails, the survivors
  report in the store and name the ranks that did not (`unresponsive_ranks`);
- waits that may legitimately be long (precompute's last rank still denoising) go through
  `wait_for_all`, which has no deadline while the peers make progress (every denoising step,
  encoded batch, training step or model load beats), and exits naming a peer that made none
  for the timeout (dead, frozen or hung);
- at start the ranks all-gather a digest of their resolved configuration and all exit, naming the
  differing keys, if they do not run the same one (`check_same_config`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from wandistill import __version__
from wandistill.checks.bounds import TIMEOUT_S, env_seconds
from wandistill.errors import UsageError, WandistillError
from wandistill.runtime import faults, waiting

TIMEOUT_ENV = "WANDISTILL_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
_POLL_S = 0.05


class DistTimeout(WandistillError):
    """A rank did not arrive, answer or finish within the distributed timeout."""


_state: dict[str, Any] = {}
"""The job's rendezvous store and heartbeat of this process (set by `init`)."""


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    """None when running as a single process without a process group."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    """A torchrun variable (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT) as a bounded int: a
    typo or a 5,000-digit value is one line naming the variable, not a ValueError."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
        raise UsageError(
            f"environment variable {name}={raw[:40]!r} is not a whole number below 10^9",
            fix=f"unset {name} (torchrun sets it), or set it to a rank count or index",
        )
    return int(raw)


def resolve_timeout(value: float | None = None) -> float:
    """The distributed timeout in seconds: the recipe's value, else WANDISTILL_DIST_TIMEOUT, else
    300; checked like every other number (finite, positive, at most a week)."""
    if value is not None:
        return float(value)
    fix = f"set {TIMEOUT_ENV} to a number of seconds"
    seconds = env_seconds(TIMEOUT_ENV, TIMEOUT_S, fix)
    return DEFAULT_TIMEOUT_S if seconds is None else seconds


def init(
    device: str = "auto",
    *,
    timeout_s: float | None = None,
    config: dict[str, Any] | None = None,
    cpu_backend: bool = False,
) -> DistInfo:
    """Join the torchrun job if there is one; pick this rank's device.

    `device`: "auto" (cuda:LOCAL_RANK when CUDA is available, else cpu), "cpu" or "cuda".
    The backend follows the device: nccl for CUDA, gloo for CPU. `timeout_s` (None: see
    `resolve_timeout`) bounds joining and every collective. `config`: the resolved configuration
    (JSON-able); every rank must run the same one (`check_same_config`). `cpu_backend`: on
    CUDA, also gloo for collectives on CPU tensors (FSDP2 with CPU offload reduces the gradient
    norm and gathers the student from host memory), as torchtitan does for CPU offload.
    """
    joined = _state.get("info")
    if joined is not None and dist.is_initialized():  # joined early (`launch` of a stage)
        if config is not None and _digest(config)[0] != _state.get("checked"):
            check_same_config(joined, config)
        return joined
    timeout = resolve_timeout(timeout_s)
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    want_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise UsageError(
            "CUDA was asked for but this machine has no usable GPU",
            fix="run on a GPU machine, or use the CPU (e.g. --set train.device=cpu)",
        )
    if want_cuda and local_rank >= torch.cuda.device_count():
        raise UsageError(
            f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible",
            fix="lower --nproc_per_node or set CUDA_VISIBLE_DEVICES",
        )
    dev = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(dev)
    backend: str | None = None
    if world > 1:
        backend = "nccl" if want_cuda else "gloo"
        if not dist.is_initialized():
            faults.at("dist", "init", 0, rank)  # test-only: a rank that never arrives
            store = _join(rank, world, timeout)
            dist.init_process_group(
                backend=cuda_and_cpu(backend) if cpu_backend and want_cuda else backend,
                store=dist.PrefixStore("default_pg", store),
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=timeout),
                device_id=dev if want_cuda else None,
            )
    info = DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, backend=backend)
    if config is not None:
        check_same_config(info, config)
    if backend is not None:
        _state["info"] = info
    return info


@contextlib.contextmanager
def leaving_on_error(info: DistInfo) -> Iterator[None]:
    """For a caller that joined the job before the stage that owns it (a stage's `launch`,
    which joins before importing the stage): leave the job if the stage fails before it took
    ownership (a check that fails before the stage's own `init`). As the stages do, never on the
    nccl error path: an nccl rank exits at once instead of waiting on its peers."""
    try:
        yield
    except BaseException:
        if info.backend != "nccl":
            cleanup()
        raise


def cuda_and_cpu(backend: str) -> str:
    """A process group backend spec for CUDA tensors through `backend` and CPU tensors through
    gloo."""
    return f"cuda:{backend},cpu:gloo"


def _join(rank: int, world: int, timeout: float) -> Any:
    """The rendezvous store (torchrun's agent store, or hosted by rank 0 as env:// does), after
    every rank has registered in it; else a DistTimeout naming the ranks that never arrived."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = _env_int("MASTER_PORT", 29500)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    host = "torchrun's agent" if agent else "rank 0"
    notice = None
    if rank != 0 or agent:  # connecting blocks until the host is up: say so if it is not
        notice = threading.Timer(
            waiting.NOTICE_S,
            lambda: print(
                f"waiting: rank {rank} of {world}: for {host} to host the rendezvous at "
                f"{addr}:{port}; giving up after {timeout:g} s ({TIMEOUT_ENV})",
                file=sys.stderr,
                flush=True,
            ),
        )
        notice.daemon = True
        notice.start()
    try:
        tcp = dist.TCPStore(
            addr,
            port,
            world_size=world,
            is_master=rank == 0 and not agent,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,  # we wait ourselves, so we can name who is missing
            multi_tenant=True,
        )
    except (RuntimeError, OSError) as e:  # DistNetworkError / DistStoreError / socket errors
        raise DistTimeout(
            f"rank {rank} of {world}: no rendezvous at {addr}:{port} within {timeout:g} s; "
            f"{host}, which hosts it, never arrived ({first_line(e)})",
            fix=f"start every rank (check rank 0's log), or raise {TIMEOUT_ENV}",
        ) from None
    finally:
        if notice is not None:
            notice.cancel()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"wandistill/{attempt}", tcp)
    store.set(f"arrived/{rank}", "1")
    store.add("arrived", 1)
    _wait_keys(store, "arrived", world, rank, timeout, "joined the job")
    _state.update(store=store, tcp=tcp, timeout=timeout, host=rank == 0 and not agent)
    _start_heartbeat(store, rank, timeout)
    return tcp


def _wait_keys(
    store: Any,
    name: str,
    world: int,
    rank: int,
    timeout: float,
    what: str,
    alive: Callable[[list[int]], list[int]] | None = None,
) -> None:
    """Wait until all `world` ranks have set `<name>/<r>`. Without `alive`: at most `timeout`
    seconds. With `alive(missing) -> stalled ranks`: for as long as no missing rank stalls."""
    start = time.monotonic()
    deadline = start + timeout
    announced = False
    while int(store.add(name, 0)) < world:
        missing = [r for r in range(world) if not store.check([f"{name}/{r}"])]
        if not announced and time.monotonic() - start > waiting.NOTICE_S:
            announced = True  # once, on rank 0 (`say`): every rank waits for the same peers
            limit = (
                f"giving up after {timeout:g} s ({TIMEOUT_ENV})"
                if alive is None
                else f"giving up if one makes no progress for {timeout:g} s ({TIMEOUT_ENV})"
            )
            waiting.say(f"for {ranks_text(missing)} of {world} to have {what}; {limit}")
        stalled = alive(missing) if alive is not None else None
        if stalled or (alive is None and time.monotonic() > deadline):
            late = stalled or missing
            raise DistTimeout(
                f"rank {rank} of {world}: {ranks_text(late)} {'has' if len(late) == 1 else 'have'} "
                f"not {what} within {timeout:g} s ({TIMEOUT_ENV})",
                fix=f"see {ranks_text(late)}'s log (it never started, hangs or died); "
                f"raise {TIMEOUT_ENV} if it is just slow; then re-run",
            )
        time.sleep(_POLL_S)


def ranks_text(ranks: list[int]) -> str:
    """`rank 2`, `ranks 1, 3`."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


_SOURCE_TAG = re.compile(r"\[(?:c10d|[^\]\s]*\.(?:cc|cpp|h|hpp|py):\d+)\]:?\s*")
"""gloo's "[../gloo/transport/tcp/pair.cc:537]" and c10d's "[c10d]" tags; a peer's
"[10.0.0.2]:29500" is kept, it names the host."""


def first_line(e: BaseException) -> str:
    """An error's first line without the libraries' source tags, at most 300 chars."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return _SOURCE_TAG.sub("", first)[:300]


# --------------------------------------------------------------------------- heartbeat


def _start_heartbeat(store: Any, rank: int, timeout: float) -> None:
    """Publish this rank's progress: every `progress.beat()` of the main thread (a denoising
    step, an encoded batch, a training step, a model load) bumps `beat/<rank>` in the store, at
    most every `period` seconds. `wait_for_all` reads it: a rank that makes no progress for the
    timeout is named, whether it died, froze or hangs."""
    from wandistill.runtime import progress

    period = max(0.05, min(2.0, timeout / 10))
    last = [0.0]

    def publish() -> None:
        now = time.monotonic()
        if now - last[0] < period:
            return
        last[0] = now
        try:
            store.add(f"beat/{rank}", 1)
        except Exception:  # the store's host is gone: the job is ending anyway
            pass

    progress.on_beat(publish)
    _state["heartbeat"] = publish


def wait_for_all(
    info: DistInfo, name: str, interrupted: Callable[[], bool] = lambda: False
) -> None:
    """A barrier with no deadline while the missing ranks are alive (their heartbeat goes on),
    and a DistTimeout naming them once one has not beaten for the timeout. Returns early (the
    caller checks why) once `interrupted()` is true, e.g. a stop signal arrived."""
    if not info.distributed or "store" not in _state:
        return
    from wandistill.runtime import progress

    store, timeout = _state["store"], _state["timeout"]
    store.set(f"{name}/{info.rank}", "1")
    store.add(name, 1)
    seen: dict[int, tuple[int, float]] = {}

    def stalled(missing: list[int]) -> list[int]:
        if interrupted():
            raise _Interrupted
        progress.beat()  # waiting is progress too: the others may be waiting on us
        now, out = time.monotonic(), []
        for r in missing:
            beats = int(store.add(f"beat/{r}", 0))
            last = seen.get(r)
            if last is None or beats != last[0]:
                seen[r] = (beats, now)
            elif now - last[1] > timeout:
                out.append(r)
        return out

    try:
        _wait_keys(store, name, info.world_size, info.rank, timeout, f"finished ({name})", stalled)
    except _Interrupted:
        return
    # The store's host (rank 0 without torchrun's agent store) must not exit, taking the store
    # with it, before every rank has seen that all are done: it waits for their "left" marks.
    store.add(f"{name}/left", 1)
    deadline = time.monotonic() + timeout
    while _state.get("host") and time.monotonic() < deadline:
        if int(store.add(f"{name}/left", 0)) >= info.world_size:
            break
        time.sleep(_POLL_S)


class _Interrupted(Exception):
    pass


def unresponsive_ranks(info: DistInfo) -> list[int]:
    """After a collective failed here: report in the store and return the ranks that do not
    report too within a tenth of the timeout (2..15 s). The survivors of a failed collective
    all get here together; the ranks missing are the ones that stopped, died or hang. [] if
    the store itself is gone (rank 0, its host, is the one that stopped)."""
    store = _state.get("store")
    if store is None or not info.distributed:
        return []
    wait = min(15.0, max(2.0, _state["timeout"] / 10))
    try:
        store.set(f"failed/{info.rank}", "1")
        deadline = time.monotonic() + wait
        while True:
            missing = [r for r in range(info.world_size) if not store.check([f"failed/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(_POLL_S)
    except Exception:  # the store's host is gone too
        return []


# --------------------------------------------------------------------------- same config


def _flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(obj, dict):
        out: dict[str, str] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix.rstrip("."): "{}"}
    return {prefix.rstrip("."): json.dumps(obj, sort_keys=True, default=str)}


def _digest(config: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The configuration's digest, and the flat key -> value view it is taken over."""
    flat = _flatten({**config, "wandistill_version": __version__})
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest(), flat


def check_same_config(info: DistInfo, config: dict[str, Any]) -> None:
    """Every rank runs the same resolved configuration, or every rank exits naming the keys that
    differ (and each rank's value). Two small collectives; the second only on a mismatch."""
    if not info.distributed:
        return
    digest, flat = _digest(config)
    digests = all_gather_json(info, digest)
    if len(set(digests)) == 1:
        _state["checked"] = digest
        return
    views: list[dict[str, str]] = all_gather_json(info, flat)
    keys = sorted({k for v in views for k in v})
    differ = [k for k in keys if len({v.get(k, "<absent>") for v in views}) > 1]
    shown = "; ".join(
        f"{k}: " + ", ".join(f"rank {r} {v.get(k, '<absent>')}" for r, v in enumerate(views))
        for k in differ[:6]
    ) + (f"; ... ({len(differ)} keys in all)" if len(differ) > 6 else "")
    raise UsageError(
        f"rank {info.rank} of {info.world_size}: the ranks run different configurations; "
        f"differing keys: {shown}",
        fix="launch every rank with the same recipe, --set overrides, flags and prompt file",
    )


def cleanup() -> None:
    from wandistill.runtime import progress

    beat = _state.pop("heartbeat", None)
    if beat is not None:
        progress.on_beat(beat, remove=True)
    _state.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier(device_ids=[info.device.index] if info.backend == "nccl" else None)


def all_gather_json(info: DistInfo, obj: Any) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order (no pickle involved)."""
    if not info.distributed:
        return [obj]
    payload = json.dumps(obj).encode()
    size = torch.tensor([len(payload)], device=info.device)
    sizes = [torch.zeros_like(size) for _ in range(info.world_size)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8, device=info.device)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    bufs = [torch.zeros_like(buf) for _ in range(info.world_size)]
    dist.all_gather(bufs, buf)
    return [
        json.loads(bytes(b[: int(s.item())].cpu().tolist()))
        for b, s in zip(bufs, sizes, strict=True)
    ]


def broadcast_json(info: DistInfo, obj: Any, src: int = 0) -> Any:
    return all_gather_json(info, obj if info.rank == src else None)[src]


def all_reduce_max(info: DistInfo, value: float) -> float:
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
