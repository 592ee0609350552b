"""Safety: no pickle on any read path, no `trust_remote_code`, no custom code from model folders,
no tar member that escapes its archive.

- the package source is scanned (AST, not text: docstrings may say "pickle") for pickle-family
  imports and names, `torch.load` without `weights_only=True`, `trust_remote_code` set to anything
  but False, `allow_pickle=True`, and webdataset `.decode(...)` without `safe_decoder()`;
- `safe_decoder()` reads real shards with stock webdataset and refuses `.pth` / `.pyd` members
  (whose payload here would create a file if it were ever unpickled) and `..` / absolute names;
- `cache verify` reports unexpected, unsafe and non-file members of a shard;
- teacher (and student) folders that ship code are refused by precompute, plan, sample and eval.
"""

from __future__ import annotations

import ast
import gzip
import io
import json
import os
import pickle
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import webdataset as wds

from wandistill.cache import open_cache
from wandistill.cache.files import WdsEntry
from wandistill.cache.manifest import read_manifest
from wandistill.cache.seal import seal_entry
from wandistill.cache.wds.decoder import UnsafeMemberError, iter_members, safe_decoder
from wandistill.cache.wds.reader import WebDatasetSource
from wandistill.cli import main

from cachefixtures import make_record, write_cache

PACKAGE = Path(__file__).parents[2] / "wandistill"
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve"}


# ----------------------------------------------------------------------------- source scan


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func) + "()"
    return "?"


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unsafe_calls(source: str, filename: str = "<src>") -> list[str]:
    """Every pickle-backed or remote-code construct in a module, as 'file:line: what'."""
    found: list[str] = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLE_MODULES:
                    hit(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in PICKLE_MODULES:
                hit(node, f"from {node.module} import ...")
            for alias in node.names:
                if "pickle" in alias.name.lower() or alias.name in {"basichandlers", "torch_loads"}:
                    hit(node, f"import of {alias.name}")
        elif isinstance(node, ast.Attribute) and (
            "pickle" in node.attr.lower()
            or node.attr in {"default_decoder", "basichandlers", "torch_loads", "autodecode"}
        ):
            hit(node, f"use of {_dotted(node)}")
        elif isinstance(node, ast.Name) and "pickle" in node.id.lower():
            hit(node, f"use of {node.id}")
        elif isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
            if not _is_const(node.value, False):
                hit(node.value, "trust_remote_code not False")
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            if not _is_const(node.value, False):
                hit(node.value, "allow_pickle not False")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.endswith(("torch.load", "torch.serialization.load")) and not _is_const(
                _kw(node, "weights_only"), True
            ):
                hit(node, f"{name} without weights_only=True")
            if isinstance(node.func, ast.Attribute) and node.func.attr == "decode":
                receiver = ast.unparse(node.func.value)
                if "WebDataset" in receiver or "wds" in receiver or "webdataset" in receiver:
                    if "safe_decoder" not in ast.unparse(node):
                        hit(node, f"webdataset .decode() without safe_decoder(): {receiver}")
            if name in {"eval", "exec"}:
                hit(node, f"{name}()")
            if name.endswith("from_pretrained") and _kw(node, "custom_pipeline") is not None:
                hit(node, "from_pretrained(custom_pipeline=...)")
    return found


def _package_sources() -> Iterator[Path]:
    yield from sorted(PACKAGE.rglob("*.py"))


def test_the_package_has_no_pickle_no_remote_code_and_no_default_webdataset_decoding() -> None:
    problems = [
        p
        for path in _package_sources()
        for p in unsafe_calls(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))
    ]
    assert problems == []


def test_the_text_trust_remote_code_true_appears_nowhere_in_the_package() -> None:
    for path in _package_sources():
        text = path.read_text(encoding="utf-8").replace(" ", "")
        assert "trust_remote_code=True" not in text, path
        assert '"trust_remote_code":True' not in text, path


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "from pickle import loads",
        "import dill as d",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=False)",
        "from transformers import AutoModel\nAutoModel.from_pretrained(p, trust_remote_code=True)",
        "from transformers import AutoModel\nAutoModel.from_pretrained(p, trust_remote_code=x)",
        "import webdataset as wds\nwds.WebDataset(u).decode()",
        "import webdataset as wds\nwds.WebDataset(u).decode('torchrgb')",
        "import webdataset as wds\nds = wds.WebDataset(u).decode(wds.autodecode.basichandlers)",
        "from webdataset.autodecode import basichandlers",
        "import pandas as pd\npd.read_pickle(p)",
        "eval(text)",
    ],
)
def test_the_scanner_catches_each_unsafe_construct(snippet: str) -> None:
    assert unsafe_calls(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load(f, weights_only=True)",
        "import webdataset as wds\nwds.WebDataset(u).decode(safe_decoder())",
        "x = raw.decode('utf-8')",
        "m.from_pretrained(p, local_files_only=True, trust_remote_code=False)",
        '"""a docstring that says pickle and torch.load(f)"""',
    ],
)
def test_the_scanner_lets_safe_code_through(snippet: str) -> None:
    assert unsafe_calls(snippet) == [], snippet


# ----------------------------------------------------------------------------- stock reads


class _Payload:
    """Unpickling this creates a directory: proof that something was unpickled."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (self.target,))


def _tar(path: Path, members: list[tuple[str, bytes]], *, link: str | None = None) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo(link)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    write_cache(tmp_path / "c", range(4), shard_records=2)
    return tmp_path / "c"


def _urls(cache: Path) -> list[str]:
    return [str(cache / s.file) for s in read_manifest(cache).shards]


@pytest.mark.parametrize("how", ["decode", "map"])
def test_safe_decoder_reads_a_cache_with_stock_webdataset(cache: Path, how: str) -> None:
    ds = wds.WebDataset(_urls(cache), shardshuffle=False)
    ds = ds.decode(safe_decoder()) if how == "decode" else ds.map(safe_decoder())
    samples = list(ds)
    assert len(samples) == 4
    for s in samples:
        want = make_record(s["json"]["seed"])
        assert s["json"]["key"] == s["__key__"] == want.key
        assert torch.equal(s["safetensors"]["xt"], want.xt)


@pytest.mark.parametrize("member", ["k.pth", "k.pyd", "k.pickle", "k.pth.gz", "k.npy"])
@pytest.mark.parametrize("how", ["decode", "map"])
def test_pickle_backed_members_are_refused_never_unpickled(
    tmp_path: Path, member: str, how: str
) -> None:
    sentinel = tmp_path / "unpickled"
    data = pickle.dumps(_Payload(sentinel))
    if member.endswith(".gz"):
        data = gzip.compress(data)
    url = _tar(tmp_path / "evil.tar", [("k.json", b'{"key": "k"}'), (member, data)])
    ds = wds.WebDataset(str(url), shardshuffle=False)
    ds = ds.decode(safe_decoder()) if how == "decode" else ds.map(safe_decoder())
    with pytest.raises(Exception) as info:
        list(ds)
    chain = [info.value, info.value.__cause__, info.value.__context__]
    assert any(isinstance(e, UnsafeMemberError) for e in chain), info.value
    assert not sentinel.exists()


def test_the_payload_really_would_run_under_default_decoding(tmp_path: Path) -> None:
    """Control for the test above: webdataset's default handlers do unpickle `.pyd`."""
    sentinel = tmp_path / "unpickled"
    url = _tar(tmp_path / "evil.tar", [("k.pyd", pickle.dumps(_Payload(sentinel)))])
    list(wds.WebDataset(str(url), shardshuffle=False).decode())
    assert sentinel.is_dir()


@pytest.mark.parametrize("name", ["../../escape.json", "/abs/escape.json", "a/../../x.json"])
def test_unsafe_member_names_are_refused(tmp_path: Path, name: str) -> None:
    url = _tar(tmp_path / "evil.tar", [(name, b"{}")])
    with pytest.raises(Exception) as info:
        list(wds.WebDataset(str(url), shardshuffle=False).map(safe_decoder()))
    chain = [info.value, info.value.__cause__, info.value.__context__]
    assert any(isinstance(e, UnsafeMemberError) for e in chain), info.value
    with pytest.raises(UnsafeMemberError, match="absolute path|'\\.\\.'"):
        list(iter_members(url))


def test_iter_members_refuses_links_and_lists_a_clean_shard(cache: Path, tmp_path: Path) -> None:
    names = [m.name for m in iter_members(_urls(cache)[0])]
    assert len(names) == 4 and all(n.endswith((".json", ".safetensors")) for n in names)
    url = _tar(tmp_path / "link.tar", [("a.json", b"{}")], link="b.json")
    with pytest.raises(UnsafeMemberError, match="not a file"):
        list(iter_members(url))


# ----------------------------------------------------------------------------- verify


def _append_members(
    cache: Path, members: list[tuple[str, bytes]], *, link: str | None = None
) -> WdsEntry:
    """Append members to shard 0 and update its manifest entry consistently (size, frame
    digest, entry digest): only the member walk can tell."""
    mpath = cache / "manifest.json"
    manifest = json.loads(mpath.read_text())
    entry = manifest["shards"][0]
    path = cache / entry["file"]
    with tarfile.open(path, "a") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo(link)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    entry["bytes"] = path.stat().st_size
    source = WebDatasetSource(cache)
    typed = WdsEntry.model_validate(entry, strict=True)
    entry["frame_sha256"] = source.frame_digest(typed, entry["file"])
    source.close()
    seal_entry(entry)
    mpath.write_text(json.dumps(manifest))
    return WdsEntry.model_validate(entry, strict=True)


def _verify(capsys: pytest.CaptureFixture[str], cache: Path) -> tuple[int, str]:
    try:
        main(["cache", "verify", str(cache)])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    ("members", "link", "message"),
    [
        (
            [("evil.pth", b"x")],
            None,
            "unexpected member 'evil.pth' (pickle-backed: never decode it)",
        ),
        ([("{k0}.pyd", b"x")], None, "unexpected member '{k0}.pyd' (pickle-backed"),
        ([("notes.txt", b"x")], None, "unexpected member 'notes.txt' (a wandistill shard holds"),
        ([("../../etc/cron.json", b"{}")], None, "member '../../etc/cron.json' contains '..'"),
        ([("/etc/x.json", b"{}")], None, "member '/etc/x.json' is an absolute path"),
        ([], "{k0}.txt", "member '{k0}.txt' is not a regular file (link or device)"),
        ([("sub/{k0}.json", b"{}")], None, "unexpected member 'sub/{k0}.json'"),
        ([("{k0}.json", b"{}")], None, "member '{k0}.json' appears twice"),
    ],
)
def test_verify_reports_unexpected_and_unsafe_members(
    cache: Path,
    capsys: pytest.CaptureFixture[str],
    members: list[tuple[str, bytes]],
    link: str | None,
    message: str,
) -> None:
    k0 = read_manifest(cache).shards[0].keys[0]
    members = [(n.format(k0=k0), d) for n, d in members]
    entry = _append_members(cache, members, link=link.format(k0=k0) if link else None)
    code, err = _verify(capsys, cache)
    assert code == 1 and f"shard {entry.name}: {message.format(k0=k0)}" in err
    with open_cache(cache) as store:  # the listed records themselves are intact and readable
        assert store.read_record(entry, 0).key == k0


# ----------------------------------------------------------------------------- model folders


def _with_code(tiny_teacher: Path, tmp_path: Path, how: str) -> tuple[Path, Path]:
    """A copy of the tiny teacher that ships code which would create `sentinel` if run."""
    import shutil

    evil = tmp_path / "evil-teacher"
    shutil.copytree(tiny_teacher, evil)
    sentinel = tmp_path / "code-ran"
    code = f"import os\nos.mkdir({str(sentinel)!r})\n"
    if how == "py-file":
        (evil / "transformer" / "modeling_evil.py").write_text(code)
    else:  # model_index names a component from a module shipped next to it
        (evil / "scheduler" / "evil_scheduler.py").write_text(code)
        index = json.loads((evil / "model_index.json").read_text())
        index["scheduler"] = ["evil_scheduler", "EvilScheduler"]
        (evil / "model_index.json").write_text(json.dumps(index))
    return evil, sentinel


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    return code, " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("how", ["py-file", "model-index"])
@pytest.mark.parametrize("command", ["precompute", "plan", "sample", "eval"])
def test_model_folders_with_code_are_refused_by_every_command(
    tiny_teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, command: str
) -> None:
    evil, sentinel = _with_code(tiny_teacher, tmp_path, how)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    student = tmp_path / "student"
    student.mkdir()
    args = {
        "precompute": ["precompute", "--teacher", str(evil), "--prompts", str(prompts),
                       "--out", str(tmp_path / "c")],
        "plan": ["plan", "--teacher", str(evil)],
        "sample": ["sample", "--teacher", str(evil), "--prompts", str(prompts),
                   "--out", str(tmp_path / "png")],
        "eval": ["eval", "--cache", str(tmp_path / "c"), "--student", str(student),
                 "--out", str(tmp_path / "e"), "--teacher", str(evil)],
    }[command]  # fmt: skip
    code, err = _cli(capsys, *args)
    assert code == 2 and "Traceback" not in err, err
    assert "contains custom code" in err and "never runs code from model folders" in err
    assert ("modeling_evil.py" if how == "py-file" else "evil_scheduler.py") in err
    assert not sentinel.exists()
    assert not (tmp_path / "c").exists() and not (tmp_path / "png").exists()


def test_a_student_folder_with_code_is_refused(
    tiny_teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    student = tmp_path / "student"
    student.mkdir()
    (student / "config.json").write_text("{}")
    (student / "hook.py").write_text("raise SystemExit('ran')\n")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    code, err = _cli(
        capsys, "sample", "--teacher", str(tiny_teacher), "--student", str(student),
        "--prompts", str(prompts), "--out", str(tmp_path / "png"),
    )  # fmt: skip
    assert code == 2 and "student" in err and "hook.py" in err and "Traceback" not in err
