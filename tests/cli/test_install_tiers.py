"""A core install (torch alone) has a working command line: ``--help`` and ``--version`` answer, and every command
that needs an extra says which in one line. Every ``--help`` answers without importing torch.

One process runs every command through `main`: first the help (torch must not be imported by it), then, with
every extra's modules hidden as Python hides an absent module (None in ``sys.modules``), the commands and
``from layerstream import Omni``, each command's stderr captured on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from layerstream.cli.main import SUBCOMMANDS
from layerstream.errors import EXTRA_OF_MODULE

PROBE = """
import contextlib, io, json, sys
from layerstream.cli.main import main

def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}

helps = {" ".join(argv): run(argv) for argv in json.loads(sys.argv[1])}
torch_after_help = "torch" in sys.modules
for name in json.loads(sys.argv[2]):
    sys.modules[name] = None  # absent, as on an install without the extras
commands = {" ".join(argv): run(argv) for argv in json.loads(sys.argv[3])}
try:
    from layerstream import Omni
    omni = "imported"
except ImportError as e:
    omni = f"{type(e).__name__}: {e}"
print(json.dumps({"helps": helps, "torch_after_help": torch_after_help, "commands": commands, "omni": omni}))
"""

HELPS = [["--help"], *([name, "--help"] for name in SUBCOMMANDS)]
COMMANDS = [["--version"], ["generate", "tiny-wan", "--steps", "1"], ["plan", "tiny-wan"], ["serve", "tiny-wan"], ["bench", "--quality"]]


@pytest.fixture(scope="module")
def core_install(tmp_path_factory) -> dict:
    """What the probe saw: the help's results, whether torch was imported by then, the commands' results."""
    hidden = sorted(set(EXTRA_OF_MODULE) - {"torch"})
    argv = [sys.executable, "-c", PROBE, json.dumps(HELPS), json.dumps(hidden), json.dumps(COMMANDS)]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path_factory.mktemp("core"), env=dict(os.environ), timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_every_help_answers_without_importing_torch(core_install):
    assert not core_install["torch_after_help"]
    for command, result in core_install["helps"].items():
        assert result["code"] == 0 and result["stdout"].startswith("usage: layerstream"), command
        assert result["stderr"] == "", command


def test_a_core_install_names_the_extra_each_command_needs(core_install):
    commands = core_install["commands"]
    version = commands.pop("--version")
    assert version["code"] == 0 and version["stdout"].startswith("layerstream 0.1.0 (torch "), version
    assert version["stderr"] == ""  # torch's own warning that numpy is missing is not shown
    extras = {"generate": "diffusers", "plan": "diffusers", "serve": "serve", "bench": "diffusers"}
    for command, result in commands.items():
        name = command.split()[0]
        assert result["code"] == 2, (command, result)
        [line] = result["stderr"].splitlines()
        assert line.startswith(f"layerstream: error: {name} needs the {extras[name]} extra (")
        assert line.endswith(f'is not installed): pip install "layerstream[{extras[name]}]"'), line
    assert core_install["omni"] == (
        'MissingExtraError: Omni needs the diffusers extra (numpy is not installed): pip install "layerstream[diffusers]"'
    )
