"""The mutation harness's list stays applicable: every mutant's text occurs exactly once in the
checkout and its selection names test files that exist (python -m tests.mutation runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutation import ROOT
from tests.mutation.mutants import MUTANTS


def test_enough_mutants_in_every_area():
    areas = [m.area for m in MUTANTS]
    assert len(MUTANTS) >= 30 and {"metal", "python", "cpp"} <= set(areas)
    assert len({m.name for m in MUTANTS}) == len(MUTANTS), "mutant names must be unique"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_applies_once_and_names_existing_tests(mutant):
    text = (ROOT / mutant.file).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.file}: the text to replace occurs {text.count(mutant.old)} times"
    assert mutant.new != mutant.old
    files = [a.split("::")[0] for a in mutant.tests if a.startswith("tests/")]
    assert files and all((Path(ROOT) / f).is_file() for f in files), mutant.tests
