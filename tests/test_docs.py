"""The README and the pages of docs/ run as written: every ``bash`` and ``python`` block, on the tiny models, in
this process (a Python block in a fresh namespace, a ``layerstream ...`` line through the command line's
`main`), each in a folder of its own. A Hub id a block names is served by the stand-in Hub on loopback, as a
copy of the tiny model of its kind. A block that talks to ``localhost:8000`` (curl in bash, a client in
Python) talks to ``layerstream serve tiny-wan`` started for them, a shell block run by bash with the venv's
``python`` first on PATH; each file it writes with ``-o`` must be an MP4. A block that cannot run here carries
``<!-- not run: REASON -->`` on the line above it; the marks are counted by reason, so a new one shows in
review, and every other block runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from hub_standin import select_standin_hub, serving_standin_hub

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGUAGES = {"bash": "shell", "sh": "shell", "shell": "shell", "console": "shell", "python": "python"}

NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->$")
REASONS = (
    "sets up a machine", "installs packages", "needs a GPU", "needs a download", "needs torchrun",
    "starts a server", "needs a running server", "needs files of your own", "too slow", "a fragment",
)  # fmt: skip
MARKED = {
    "sets up a machine": 1,
    "installs packages": 1,
    "needs a GPU": 1,
    "needs a download": 3,
    "needs torchrun": 4,
    "starts a server": 5,
    "needs files of your own": 2,
    "too slow": 1,
    "a fragment": 1,
}
"""Marked blocks by reason: a block newly marked (or made to run) changes this on purpose."""

HUB_STANDINS = {"Wan-AI/Wan2.2-T2V-A14B-Diffusers": "tiny-wan"}
"""Hub id a runnable block names -> the tiny model the stand-in Hub serves under it."""
SERVED = re.compile(r"\b(?:localhost|127\.0\.0\.1):8000\b")
"""How a block names the server it talks to (the port the docs serve on)."""
HUB_ID = re.compile(r"\b(?:Wan-AI|black-forest-labs|Qwen|tencent|Lightricks|stabilityai)/[\w.-]+")

FEW_STEPS = 2
# A copy of a tiny model on the Hub has the real model's defaults (480x832, 81 frames for Wan): asked small
SMALL_HUB_CALL = f"num_inference_steps={FEW_STEPS}, height=32, width=32, num_frames=5"


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    kind: str  # "shell" or "python"
    source: str
    not_run: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def hub_ids(self) -> set[str]:
        return set(HUB_ID.findall(self.source))


def _blocks() -> list[Block]:
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.fullmatch(r"```(\w*)\s*", lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            kind = RUN_LANGUAGES.get(fence[1])
            if kind:
                mark = NOT_RUN.match(lines[i - 1]) if i else None
                source = "\n".join(lines[i + 1 : end])
                found.append(Block(page.relative_to(ROOT).as_posix(), i + 1, kind, source, mark[1] if mark else None))
            i = end + 1
    return found


BLOCKS = _blocks()
TO_RUN = [b for b in BLOCKS if b.not_run is None]


def test_every_block_runs_or_says_why_not():
    reasons = Counter()
    for block in BLOCKS:
        if block.not_run is not None:
            category = next((r for r in REASONS if block.not_run.startswith(r)), None)
            assert category, f"{block.id}: {block.not_run!r} is not one of {REASONS}"
            reasons[category] += 1
    assert dict(reasons) == MARKED, f"marked blocks by reason: {dict(reasons)}"
    for page in PAGES:  # a mark stands right above the block it excuses, never astray
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("<!-- not run"):
                assert NOT_RUN.match(line) and i + 1 < len(lines) and re.fullmatch(r"```\w+\s*", lines[i + 1]), f"{page.name}:{i + 1}"
    assert len(TO_RUN) >= 15 and len(BLOCKS) == len(TO_RUN) + sum(MARKED.values())
    for block in TO_RUN:
        assert block.hub_ids() <= set(HUB_STANDINS), f"{block.id}: no stand-in for {block.hub_ids() - set(HUB_STANDINS)}"


def test_no_page_cites_an_issue_or_a_work_item():
    """The docs describe the product; where a figure came from is a benchmark or a test, not a work item."""
    for page in PAGES:
        cited = re.findall(r"\b(?:issue|item|work item) #?\d+", page.read_text(), re.I)
        assert not cited, f"{page.name}: {cited}"


def test_the_readme_keeps_the_set_up_commands_first_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    first = next(b for b in BLOCKS if b.page == "README.md")
    assert first.source.splitlines()[0].startswith("make demo") and "make test" in first.source
    assert 'Omni(model="Wan-AI/Wan2.2-T2V-A14B-Diffusers"' in readme
    assert len(readme.splitlines()) <= 150


@pytest.fixture(scope="module")
def standin_hub():
    from layerstream.models import ensure_tiny_model

    with serving_standin_hub() as hub:
        for repo_id, tiny in HUB_STANDINS.items():
            hub.add_repo(repo_id, ensure_tiny_model(tiny))
        yield hub


@pytest.fixture
def block_folder(tmp_path, monkeypatch):
    """A folder of the block's own, holding the input images the docs name (fox.png is 50x35, so that the size
    notes the docs quote hold)."""
    from PIL import Image

    Image.new("RGB", (50, 35), (200, 90, 30)).save(tmp_path / "fox.png")
    Image.new("RGB", (64, 64), (90, 90, 90)).save(tmp_path / "cat.png")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _adapted_python(block: Block) -> str:
    """The block with few steps (and, for a Hub id, a tiny size), so that it runs in a second or two."""
    call = SMALL_HUB_CALL if block.hub_ids() else f"num_inference_steps={FEW_STEPS}"
    return re.sub(r"num_inference_steps=\d+", call, block.source)


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    """``layerstream serve tiny-wan`` with its defaults, for the blocks that talk to a server (started by the
    first of them)."""
    sys.path.insert(0, str(ROOT / "tests" / "server"))
    from serve_harness import start_server

    server = start_server("tiny-wan", folder=tmp_path_factory.mktemp("docs-serve"))
    yield server
    server.kill()


def _run_against(server, block: Block, folder: Path) -> None:
    """Run `block` against `server`: a Python block in this process, a shell block (curl) by bash."""
    source = SERVED.sub(server.url.removeprefix("http://"), block.source)
    if block.kind == "python":
        with warnings.catch_warnings():  # OpenAI's client marks its videos API deprecated: not the docs' concern
            warnings.simplefilter("ignore", DeprecationWarning)
            exec(compile(source, block.id, "exec"), {"__name__": "__docs__"})
        return
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python` is the venv's, as activated
    done = subprocess.run(["bash", "-eo", "pipefail", "-c", source], cwd=folder, env={**os.environ, "PATH": path},
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, f"{block.id}: exit {done.returncode}\n{done.stderr}\n{server.log()[-3000:]}"
    for name in re.findall(r"-o (\S+)", block.source):
        assert (folder / name).read_bytes()[4:8] == b"ftyp", f"{block.id}: {name} is not an MP4"


def _shell_commands(block: Block) -> list[list[str]]:
    joined = re.sub(r"\\\n\s*", " ", block.source)
    commands = [shlex.split(line, comments=True) for line in joined.splitlines()]
    commands = [c for c in commands if c]
    for argv in commands:
        assert argv[0] == "layerstream", f"{block.id}: an unmarked shell block runs only layerstream, not {argv[0]}"
    return [argv[1:] for argv in commands]


def _few_steps(argv: list[str]) -> list[str]:
    return [str(FEW_STEPS) if i and argv[i - 1] == "--steps" else a for i, a in enumerate(argv)]


@pytest.mark.parametrize("block", TO_RUN, ids=[b.id for b in TO_RUN])
def test_the_block_runs(block, block_folder, layerstream_cli, standin_hub, monkeypatch, request):
    if SERVED.search(block.source):
        _run_against(request.getfixturevalue("docs_server"), block, block_folder)
        return
    if block.hub_ids():
        select_standin_hub(standin_hub, monkeypatch, block_folder, fresh=False)
    if block.kind == "python":
        code = compile(_adapted_python(block), block.id, "exec")
        exec(code, {"__name__": "__docs__"})
        return
    for argv in _shell_commands(block):
        result = layerstream_cli(*_few_steps(argv))
        assert result.returncode == 0, f"{block.id}: layerstream {shlex.join(argv)}\n{result.stderr}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_reaches_a_file_and_its_heading():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: {target}"
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                assert anchor in {_anchor(h) for h in headings}, f"{page.name}: {target}"
