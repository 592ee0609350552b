"""The CLI in real processes without paying the imports each time: a forking "zygote".

A CLI subprocess spends seconds importing torch, diffusers and transformers before it does
anything. The zygote is one process that imported all of that once; every run is a fork of it
that calls `wandistill.cli.main(argv)`: the real command line, in a real process with its own
pid, exit code, stdout/stderr and signals (it really gets SIGKILL and SIGTERM). For N ranks it
forks one child per rank with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
and, like torchrun, SIGTERMs the other ranks when one fails.

What a fork does not test: the interpreter's start-up and the imports themselves (library
output at import time, the console script). Tests about those start `python -m wandistill`.
Real torchrun runs stay in test_signals.py, test_dist_failure.py and test_train_dist.py.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
HANG_GUARD_S = 240.0  # a run that takes this long is stuck; never a measure of speed

ZYGOTE = r"""
import json, os, signal, socket, sys, time, traceback

import torch  # noqa: F401  (everything a run imports, imported once, before any fork)
import diffusers, transformers  # noqa: F401
from diffusers import AutoencoderKLWan, WanTransformer3DModel  # noqa: F401
from transformers import AutoTokenizer, UMT5EncoderModel  # noqa: F401
import wandistill.cli
import wandistill.precompute.run, wandistill.train.loop  # noqa: F401
import wandistill.teacher.encode, wandistill.teacher.folder  # noqa: F401
import wandistill.placement.load, wandistill.cache.reader  # noqa: F401

reply = os.fdopen(int(sys.argv[1]), "w", buffering=1)


def child(argv, env, log, split=False):
    code = 1
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        if split:  # stderr beside stdout, in <log>.err
            os.close(fd)
            fd = os.open(log + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        try:
            wandistill.cli.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def job(req):
    n = req["nproc"]
    env = dict(req["env"])
    if n > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    pids = []
    for r in range(n):
        renv = dict(env)
        if n > 1:
            renv.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                        LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        pid = os.fork()
        if pid == 0:
            child(req["argv"], renv, f"{req['log']}.{r}", req.get("split", False))
        pids.append(pid)
    reply.write(json.dumps({"pids": pids}) + "\n")
    codes = {}
    grace = None
    while len(codes) < n:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if grace is not None and time.monotonic() > grace:
                for p in pids:
                    if p not in codes:
                        os.kill(p, signal.SIGKILL)
                grace = None
            time.sleep(0.005)
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and grace is None and len(codes) < n:  # torchrun: stop the rest
            for p in pids:
                if p not in codes:
                    os.kill(p, signal.SIGTERM)
            grace = time.monotonic() + 30
    reply.write(json.dumps({"codes": [codes[p] for p in pids]}) + "\n")


for line in sys.stdin:
    job(json.loads(line))
"""


class Zygote:
    """A process that imported everything once and forks one child per rank per run."""

    def __init__(self) -> None:
        rfd, wfd = os.pipe()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120", "PYTHONUNBUFFERED": "1"}
        for k in ("WANDISTILL_FAULT", "RANK", "WORLD_SIZE"):
            env.pop(k, None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(wfd)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            pass_fds=(wfd,),
            text=True,
        )
        os.close(wfd)
        self._fd = rfd
        self._buf = b""

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                raise TimeoutError(f"no reply from the zygote within {timeout:.0f} s")
            chunk = os.read(self._fd, 65536)
            if not chunk:
                raise RuntimeError(f"the zygote died (exit {self.proc.poll()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def start(
        self, argv: list[str], log: Path, *, nproc: int = 1, split: bool = False, **env: str | None
    ) -> list[int]:
        """Fork the run; `env` is set (None: unset) in the children only. Output goes to
        `<log>.<rank>` (with `split`, stderr to `<log>.<rank>.err`)."""
        assert self.proc.stdin is not None
        req = {"argv": argv, "env": env, "log": str(log), "nproc": nproc, "split": split}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._reply(HANG_GUARD_S)["pids"]

    def wait(self, pids: list[int]) -> list[int]:
        try:
            return self._reply(HANG_GUARD_S)["codes"]
        except TimeoutError:
            for p in pids:
                kill(p, signal.SIGKILL)
            self._reply(60)
            pytest.fail(f"a run hung for {HANG_GUARD_S:.0f} s")

    def run(self, argv: list[str], log: Path, *, nproc: int = 1, **env: str | None) -> list[int]:
        return self.wait(self.start(argv, log, nproc=nproc, **env))

    def cli(self, argv: list[str], log: Path, **env: str | None) -> subprocess.CompletedProcess:
        """`wandistill ARGV` in one forked process, read back like `subprocess.run(...,
        capture_output=True, text=True)`: its exit code (-9 when SIGKILLed), stdout, stderr."""
        (code,) = self.wait(self.start(argv, log, split=True, **env))
        out = Path(f"{log}.0").read_text(errors="replace")
        err = Path(f"{log}.0.err").read_text(errors="replace")
        return subprocess.CompletedProcess(["wandistill", *argv], code, out, err)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._fd)


def kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def logs(log: Path, nproc: int = 1) -> str:
    """Every rank's output of a run started with `Zygote.start` / `Zygote.run`."""
    return "\n".join(
        Path(f"{log}.{r}{ext}").read_text(errors="replace")
        for r in range(nproc)
        for ext in ("", ".err")
        if Path(f"{log}.{r}{ext}").exists()
    )


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not yet reaped by the zygote, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
