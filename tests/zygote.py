"""The CLI in real processes without paying the imports each time: a forking "zygote".

A CLI subprocess spends seconds importing torch, diffusers and transformers before it does
anything. The zygote is one process that imported all of that once; every run is a fork of it:
the real command line, in a real process with its own pid, exit code, stdout/stderr and signals
(it really gets SIGKILL and SIGTERM). Two ways in:

- `Zygote.start/run/cli`: `wandistill.cli.main(argv)` in N forked ranks with torchrun's
  environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); like torchrun, the other ranks get
  SIGTERM when one fails. The test holds the ranks' own pids (for SIGKILL at a chosen point).
- `Zygote.bin` / `Zygote.env()`: executables named `python`, `wandistill` and `torchrun` that
  hand their argv, environment, working folder and stdin/stdout/stderr (the file descriptors
  themselves) to the zygote, which forks the run; the executable forwards the signals it gets
  to that fork and exits as it did (a fork killed by a signal kills it with the same signal).
  `PYTHON_EXEC` (torchrun's own knob) makes torchrun start its ranks this way. So a command line
  run by bash, torchrun's agent and its ranks are all forks, unchanged in what they run. The
  shim's own pid is not the fork's: with `ZYGOTE_PID_FILE=PATH` in its environment the shim
  writes the fork's pid there (`fork_pid`); a test that signals a rank by pid uses `start`.
  A `python` fork's `sys.executable` is that shim, so what it starts with it is a fork too.

What a fork does not test: the interpreter's start-up and the imports themselves (library
output at import time, the console script). Tests about those start `python -m wandistill`
(test_startup_imports, test_wheel_demo, test_cli_surface); test_signals keeps real torchrun.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
HANG_GUARD_S = 240.0  # a run that takes this long is stuck; never a measure of speed
START_GUARD_S = 900.0  # the imports, on a box loaded many times over: only a hang guard

ZYGOTE = r"""
import atexit, json, os, runpy, select, signal, socket, sys, time, traceback

import torch  # everything a run imports, imported once, before any fork
import diffusers, transformers  # noqa: F401
from diffusers import AutoencoderKLWan, WanTransformer3DModel  # noqa: F401
from transformers import AutoTokenizer, UMT5EncoderModel  # noqa: F401
import torch.distributed.run  # noqa: F401
import wandistill.cli
import wandistill.precompute.run, wandistill.train.loop  # noqa: F401
import wandistill.teacher.encode, wandistill.teacher.folder  # noqa: F401
import wandistill.placement.load, wandistill.cache.reader  # noqa: F401

# The intra-op thread count a fresh interpreter picks without OMP_NUM_THREADS (this process was
# started without it and has run no torch op: no thread pool exists yet to be forked).
DEFAULT_THREADS = torch.get_num_threads()
reply = os.fdopen(int(sys.argv[1]), "w", buffering=1)
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[2])
listener.listen(64)
reply.write(json.dumps({"id": 0, "pids": []}) + "\n")  # ready
keep = set()  # file descriptors every fork closes (the zygote's own)


def become(env, fds):
    # The fork takes the run's environment and standard streams, as a fresh process has them.
    for fd in keep:
        try:
            os.close(fd)
        except OSError:
            pass
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra  # as a fresh interpreter puts PYTHONPATH after the script's folder
    threads = env.get("OMP_NUM_THREADS", "")
    threads = int(threads) if threads.isdigit() and int(threads) > 0 else DEFAULT_THREADS
    torch.set_num_threads(threads)
    for name in ("wandistill.cli", "wandistill.cli.entry"):  # read at import by the CLI
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "_debug"):
            module._debug = bool(env.get("WANDISTILL_DEBUG"))


def python(argv):
    # `python [-u] -m MODULE ARGS`, `python [-u] -c CODE ARGS`, `python [-u] SCRIPT ARGS`.
    while argv and argv[0] in ("-u", "-B"):
        argv = argv[1:]
    if argv[:1] == ["-m"]:
        if not hasattr(sys.modules.get(argv[1]), "__path__"):  # a module, not a package:
            sys.modules.pop(argv[1], None)  # unimported, as in a fresh `python -m` (no warning)
        sys.argv = ["-m", *argv[2:]]
        runpy._run_module_as_main(argv[1], alter_argv=True)
    elif argv[:1] == ["-c"]:
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv and not argv[0].startswith("-"):
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    else:  # anything else: the real interpreter, in this process (slower, still correct)
        os.execv(sys.executable, [sys.executable, *argv])


def run(kind, argv):
    code = 1
    try:
        try:
            if kind == "python":
                python(argv)
                code = 0
            elif kind == "torchrun":
                sys.argv = ["torchrun", *argv]
                code = torch.distributed.run.main()
            else:  # wandistill, as its console script does
                sys.argv = ["wandistill", *argv]
                code = wandistill.cli.main()
            code = 0 if code is None else code
        except SystemExit as e:
            code = e.code
        if not isinstance(code, int):
            if code is not None:
                print(code, file=sys.stderr)
            code = 0 if code is None else 1
    except KeyboardInterrupt:
        traceback.print_exc()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def log_fds(log, split):
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    err = os.open(log + ".err", flags, 0o644) if split else os.dup(out)
    return [os.open(os.devnull, os.O_RDONLY), out, err]


def fork(env, fds, kind, argv, cwd=None, exe=None):
    pid = os.fork()
    if pid == 0:
        try:
            become(env, fds)
            if cwd:
                os.chdir(cwd)
            if exe:  # a `python` fork's interpreter is the `python` that started it
                sys.executable = exe
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        run(kind, argv)
    for fd in fds:
        os.close(fd)
    return pid


jobs = {}  # id -> {"pids": [...], "codes": {pid: code}, "grace": deadline or None}
owner = {}  # pid -> ("job", id) or ("shim", socket)
shims = {}  # socket fd -> (socket, pid): the shim's end closing (it was killed) kills the fork


def job(req):
    n, env = req["nproc"], {**req["env"]}
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
        fds = log_fds(f"{req['log']}.{r}", req.get("split", False))
        pid = fork(renv, fds, "wandistill", req["argv"])
        owner[pid] = ("job", req["id"])
        pids.append(pid)
    jobs[req["id"]] = {"pids": pids, "codes": {}, "grace": None}
    reply.write(json.dumps({"id": req["id"], "pids": pids}) + "\n")


def shim(conn):
    conn.settimeout(120)  # the shim sends at once; only a stuck one waits this long
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while data and not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        data += more
    if not data.endswith(b"\n"):
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    req = json.loads(data)
    fds = list(fds)
    keep.add(conn.fileno())  # not inherited by the fork: only the shim holds its end
    while len(fds) < 3:  # a standard stream the shim did not have open
        fds.append(os.open(os.devnull, os.O_RDWR))
    exe = req["exe"] if req["kind"] == "python" else None
    pid = fork(req["env"], fds, req["kind"], req["argv"], req["cwd"], exe)
    conn.settimeout(None)
    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    owner[pid] = ("shim", conn)
    shims[conn.fileno()] = (conn, pid)


def exited(pid, code):
    kind, ref = owner.pop(pid)
    if kind == "shim":
        shims.pop(ref.fileno(), None)
        keep.discard(ref.fileno())
        try:
            ref.sendall((json.dumps({"code": code}) + "\n").encode())
        except OSError:
            pass
        ref.close()
        return
    j = jobs[ref]
    j["codes"][pid] = code
    if len(j["codes"]) == len(j["pids"]):
        reply.write(json.dumps({"id": ref, "codes": [j["codes"][p] for p in j["pids"]]}) + "\n")
        del jobs[ref]
    elif code != 0 and j["grace"] is None:  # torchrun: stop the rest
        for p in j["pids"]:
            if p not in j["codes"]:
                os.kill(p, signal.SIGTERM)
        j["grace"] = time.monotonic() + 30


wake_r, wake_w = os.pipe()  # SIGCHLD wakes the select below (signal.set_wakeup_fd)
os.set_blocking(wake_r, False)
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
keep.update({listener.fileno(), reply.fileno(), 0, wake_r, wake_w})
os.set_blocking(0, False)
pending = b""
while True:
    wait = 0.05 if any(j["grace"] is not None for j in jobs.values()) else 1.0
    ready = select.select([0, wake_r, listener, *(c for c, _ in shims.values())], [], [], wait)[0]
    for r in ready:
        if r == wake_r:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        elif r == 0:
            chunk = os.read(0, 1 << 20)
            if not chunk:
                sys.exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                job(json.loads(line))
        elif r is listener:
            conn, _ = listener.accept()
            try:
                shim(conn)
            except (OSError, ValueError):
                traceback.print_exc()
                conn.close()
        elif r.fileno() in shims and not r.recv(1, socket.MSG_PEEK):  # the shim is gone
            try:
                os.kill(shims[r.fileno()][1], signal.SIGKILL)
            except ProcessLookupError:
                pass
            keep.discard(r.fileno())
            del shims[r.fileno()]
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        exited(pid, os.waitstatus_to_exitcode(status))
    now = time.monotonic()
    for j in jobs.values():
        if j["grace"] is not None and now > j["grace"]:
            for p in j["pids"]:
                if p not in j["codes"]:
                    os.kill(p, signal.SIGKILL)
            j["grace"] = None
"""

SHIM = r"""#!{python} -S
import json, os, signal, socket, sys

s = socket.socket(socket.AF_UNIX)
s.connect({sock!r})
fds = []
for fd in (0, 1, 2):
    try:
        os.fstat(fd)
    except OSError:
        break
    fds.append(fd)
env = dict(os.environ)
pidfile = env.pop("ZYGOTE_PID_FILE", None)  # this process's own, not its run's children's
req = {{"kind": {kind!r}, "argv": sys.argv[1:], "env": env, "cwd": os.getcwd(), "exe": __file__}}
socket.send_fds(s, [json.dumps(req).encode() + b"\n"], fds)
f = s.makefile("rb")
pid = json.loads(f.readline())["pid"]
if pidfile:  # the fork's pid, for a test that looks for its children (a torchrun's ranks)
    with open(pidfile + ".tmp", "w") as out:
        out.write(str(pid))
    os.replace(pidfile + ".tmp", pidfile)


def forward(sig, _frame):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2):
    signal.signal(sig, forward)
line = f.readline()
code = json.loads(line)["code"] if line else 1
if code < 0:  # killed by a signal: so is this process, as its parent expects
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


class Zygote:
    """A process that imported everything once and forks one process per rank per run."""

    def __init__(self, **own_env: str) -> None:
        """`own_env`: set in the zygote's own environment, so in what runs at its start-up (a
        `sitecustomize`) and what its imports read (each run still gets its own environment)."""
        self.dir = Path(tempfile.mkdtemp(prefix="zygote-"))  # short: a socket path has a limit
        sock = self.dir / "s"
        self.bin = self.dir / "bin"
        self.bin.mkdir()
        for kind in ("python", "wandistill", "torchrun"):
            exe = self.bin / kind
            exe.write_text(SHIM.format(python=sys.executable, sock=str(sock), kind=kind))
            exe.chmod(0o755)
        self.python = str(self.bin / "python")
        """`python` for subprocess argv: `[zygote.python, "-m", "wandistill", ...]`."""
        rfd, wfd = os.pipe()
        self.own_env = own_env
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **own_env}
        # Read when torch and rich start: left to each run's own environment (see `become`).
        for k in ("WANDISTILL_FAULT", "RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "COLUMNS"):
            env.pop(k, None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(wfd), str(sock)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            pass_fds=(wfd,),
            text=True,
        )
        os.close(wfd)
        self._fd = rfd
        self._buf = b""
        self._ids = 0
        self._replies: dict[tuple[int, str], list[int]] = {}
        self._jobs: dict[tuple[int, ...], int] = {}
        self._reply((0, "pids"), START_GUARD_S)  # its imports done, it listens

    def env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """`env` (default: this process's) and the zygote's own, with `python`, `wandistill` and
        `torchrun` first on PATH and torchrun's ranks started through the zygote (`PYTHON_EXEC`)."""
        env = {**(os.environ if env is None else env), **self.own_env}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHON_EXEC"] = self.python
        return env

    def _reply(self, key: tuple[int, str], timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while key not in self._replies:
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                    raise TimeoutError(f"no reply from the zygote within {timeout:.0f} s")
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    raise RuntimeError(f"the zygote died (exit {self.proc.poll()})")
                self._buf += chunk
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            what = "pids" if "pids" in msg else "codes"
            self._replies[(msg["id"], what)] = msg[what]
        return self._replies.pop(key)

    def start(
        self, argv: list[str], log: Path, *, nproc: int = 1, split: bool = False, **env: str | None
    ) -> list[int]:
        """Fork the run; `env` is set (None: unset) in the children only, over this process's
        environment and the zygote's own, with one intra-op thread and 120 columns. Output goes
        to `<log>.<rank>` (with `split`, stderr to `<log>.<rank>.err`)."""
        assert self.proc.stdin is not None
        base = {**os.environ, **self.own_env, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
        base["PYTHONUNBUFFERED"] = "1"
        for k in ("WANDISTILL_FAULT", "RANK", "WORLD_SIZE"):
            base.pop(k, None)
        for k, v in env.items():
            if v is None:
                base.pop(k, None)
            else:
                base[k] = v
        self._ids += 1
        req = {"id": self._ids, "argv": argv, "env": base, "log": str(log), "nproc": nproc,
               "split": split}  # fmt: skip
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        pids = self._reply((self._ids, "pids"), HANG_GUARD_S)
        self._jobs[tuple(pids)] = self._ids
        return pids

    def wait(self, pids: list[int]) -> list[int]:
        key = (self._jobs.pop(tuple(pids)), "codes")
        try:
            return self._reply(key, HANG_GUARD_S)
        except TimeoutError:
            for p in pids:
                kill(p, signal.SIGKILL)
            self._reply(key, 60)
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

    def torchrun(
        self, args: list[str], *, nproc: int = 2, env: dict[str, str] | None = None, **kw
    ) -> subprocess.CompletedProcess:
        """`torchrun --standalone --nproc_per_node=NPROC ARGS` (ARGS: `-m wandistill ...` or a
        script), its agent and ranks forks of this zygote, in a session of its own; stdout and
        stderr captured as text. `env`: the environment (default: this process's); `kw` go to
        Popen (cwd: the repository)."""
        cmd = [self.python, "-m", "torch.distributed.run", "--standalone"]
        proc = subprocess.Popen(
            [*cmd, f"--nproc_per_node={nproc}", *args],
            env=self.env(env),
            **{"cwd": REPO, **kw},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=HANG_GUARD_S)  # a hang guard, not a timing
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"torchrun hung:\n{proc.communicate()[1][-3000:]}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._fd)
        for p in sorted(self.dir.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        self.dir.rmdir()


def fork_pid(pidfile: Path, shim: subprocess.Popen) -> int | None:
    """The pid of the fork a shim started with `ZYGOTE_PID_FILE=pidfile` runs in (None once the
    shim ended without one)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not pidfile.exists():
        if shim.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    return int(pidfile.read_text())


def kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_and_wait(pid: int) -> None:
    """SIGKILL `pid` and return once it has exited: an exited process (even a zombie not yet
    reaped) has closed its files, so its locks are free. For forks another process reaps (a
    shim's); `Zygote.wait` for the zygote's own."""
    kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + HANG_GUARD_S  # a hang guard, not a timing
    while alive(pid):
        if time.monotonic() > deadline:
            pytest.fail(f"pid {pid} still runs {HANG_GUARD_S:.0f} s after SIGKILL")
        time.sleep(0.005)


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
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone (even mid-read)
        return False
