"""The mutation check's list (`tests/mutants.py`) matches the code: every original snippet is found exactly once
in its file of the current src, and every selected test exists; a snippet that moved is named."""

from __future__ import annotations

import dataclasses

import pytest
from mutants import MUTANTS, MutantListError, check_mutants

pytestmark = pytest.mark.fast


def test_every_mutant_applies_to_the_current_code_and_selects_existing_tests():
    check_mutants()
    assert {m.name for m in MUTANTS} >= {
        "prefetch-wait", "slot-release", "thread-adoption", "job-ending-guard", "work-cap-product",
        "lossless-escape-count", "decode-scratch-term", "planner-resident-count", "disk-offset", "atomic-rename",
    }  # fmt: skip


def test_a_snippet_not_found_once_or_a_missing_test_is_named(tmp_path):
    package = tmp_path / "src" / "layerstream"
    package.mkdir(parents=True)
    (package / "twice.py").write_text("x = 1\nx = 1\n")
    base = MUTANTS[0]
    moved = dataclasses.replace(base, name="moved", file="twice.py", original="y = 2", tests=())
    doubled = dataclasses.replace(base, name="doubled", file="twice.py", original="x = 1", tests=())
    renamed = dataclasses.replace(base, name="renamed", file="twice.py", original="x = 1\nx", tests=("tests/test_gone.py::test_x",))
    with pytest.raises(MutantListError) as listed:
        check_mutants((moved, doubled, renamed), package=package, root=tmp_path)
    message = str(listed.value)
    assert "moved: the original 'y = 2' is found 0 times in twice.py" in message
    assert "doubled: the original 'x = 1' is found 2 times" in message
    assert "renamed: the selected test file tests/test_gone.py does not exist" in message
