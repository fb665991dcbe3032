"""Every snippet in README.md runs as written, in order, and prints what the README shows.

One fresh Python process runs the README's blocks top to bottom: each ``python`` block executed in
one shared namespace (as a user pasting them into one session would), each ``bash`` block's lines
as shell commands in between (from the repository root, where a user runs them). A ``text`` block right after a run block is that block's expected
output: each of its lines must appear in what the block printed, with every number free to differ
(runs differ in their last digits). A block the tests cannot run is preceded by
``<!-- not run: WHY -->``, which must say why; any other block must be python, a zero_ray
command (``zero-ray ...``, ``python examples/...``, ``python -m benchmarks...``) or output.

"Two commands" is not run here: its commands create a virtual environment and install into it;
``tests/unit/test_readme.py`` checks them, and ``.ci/run`` is the second.

The S3 recipe's bucket is the tests' local S3 server (moto), reached through the standard
``AWS_*`` variables as a user's bucket would be; the process starts its own local Ray, as the
README's first block says, and none of the session's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests_paths import REPO_ROOT

pytest.importorskip("transformers")
pytest.importorskip("peft")

README = os.path.join(REPO_ROOT, "README.md")
SKIPPED_SECTIONS = ("## Two commands",)
RUNNABLE_BASH = ("zero-ray ", "python examples/", "python -m benchmarks")
BUCKET = "my-bucket"
DEADLINE_S = 420  # the whole README, Ray's start included: 70-160 s on this 2-core machine, idle to loaded

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*$", re.S)
_NUMBER = re.compile(r"[-+]?(?:\d[\d,_]*\.?\d*|\.\d+)(?:e[-+]?\d+)?", re.I)


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    not_run: str | None  # the reason, when marked


def readme_blocks() -> list[Block]:
    """The fenced blocks of README.md outside the skipped sections, in order."""
    with open(README, encoding="utf-8") as fh:
        text = fh.read()
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()]
        section = before[before.rfind("\n## ") + 1:].split("\n", 1)[0] if "\n## " in before else ""
        if section.startswith(SKIPPED_SECTIONS):
            continue
        mark = _NOT_RUN.search(before.rstrip("\n").rsplit("\n\n", 1)[-1])
        blocks.append(Block(lang=match.group(1), code=match.group(2), line=before.count("\n") + 1,
                            not_run=mark.group(1) if mark else None))
    return blocks


def _skeleton(line: str) -> str:
    return " ".join(_NUMBER.sub("#", line).split())


def test_every_block_is_runnable_output_or_marked_with_a_reason() -> None:
    blocks = readme_blocks()
    assert sum(b.lang == "python" and b.not_run is None for b in blocks) >= 3  # the recipes
    for block in blocks:
        where = f"README.md:{block.line}"
        if block.not_run is not None:
            assert len(block.not_run.split()) >= 2, f"{where}: say why it is not run"
            continue
        assert block.lang in ("python", "bash", "text"), f"{where}: a {block.lang!r} block; mark it not run, and why"
        if block.lang == "bash":
            for command in _commands(block):
                assert command.startswith(RUNNABLE_BASH), f"{where}: {command!r} is no zero_ray command: mark it"


def _commands(block: Block) -> list[str]:
    return [line.split("  #")[0].strip() for line in block.code.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


_RUNNER = r"""
import json, subprocess, sys, traceback
items, root = json.load(open(sys.argv[1])), sys.argv[2]
namespace = {"__name__": "__main__"}
for i, item in enumerate(items):
    print(f"\n@@@ block {i} @@@", flush=True)
    try:
        if item["lang"] == "python":
            exec(compile(item["code"], f"README.md:{item['line']}", "exec"), namespace)
        else:
            for command in item["commands"]:
                out = subprocess.run(command, shell=True, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                print(out.stdout, flush=True)
                if out.returncode:
                    raise SystemExit(f"README.md:{item['line']}: {command!r} exited {out.returncode}")
    except BaseException:
        traceback.print_exc()
        print(f"@@@ failed {i} @@@", flush=True)
        sys.exit(1)
    sys.stdout.flush()
print("\n@@@ done @@@", flush=True)
"""


@pytest.mark.slow
def test_the_readme_runs_as_written_and_prints_what_it_shows(s3, tmp_path) -> None:  # type: ignore[no-untyped-def]
    s3.create_bucket(BUCKET)
    blocks = [b for b in readme_blocks() if b.not_run is None]
    runs = [b for b in blocks if b.lang in ("python", "bash")]
    items = [{"lang": b.lang, "code": b.code, "line": b.line, "commands": _commands(b)} for b in runs]
    (tmp_path / "blocks.json").write_text(json.dumps(items))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update(s3.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(tmp_path / "blocks.json"), REPO_ROOT],
                          cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0 and "@@@ done @@@" in proc.stdout, proc.stdout[-12000:]
    printed = dict(zip(range(len(runs)), re.split(r"\n@@@ block \d+ @@@\n", proc.stdout)[1:]))
    # Each expected-output block belongs to the run block just before it.
    for i, block in enumerate(blocks):
        if block.lang != "text":
            continue
        before = blocks[i - 1] if i else None
        assert before is not None and before.lang in ("python", "bash"), f"README.md:{block.line}: output of what?"
        seen = {_skeleton(line) for line in printed[runs.index(before)].splitlines()}
        for line in block.code.splitlines():
            if line.strip() and "..." not in line:
                assert _skeleton(line) in seen, (f"README.md:{block.line}: {line!r} is not what the block printed:\n"
                                                 + printed[runs.index(before)][-6000:])
