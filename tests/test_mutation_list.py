"""The mutation harness's lists stay applicable: every mutant's text occurs exactly once in the
checkout and its selection names test files that exist (python -m tests.mutation runs them).
Checked for the curated list and the second to fourteenth audit lists (--fresh2 .. --fresh14); the first audit list
(--fresh) points into files that are rewritten often and is re-anchored when it is run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutation import ROOT
from tests.mutation.fresh2_mutants import MUTANTS as FRESH2
from tests.mutation.fresh3_mutants import MUTANTS as FRESH3
from tests.mutation.fresh4_mutants import MUTANTS as FRESH4
from tests.mutation.fresh5_mutants import MUTANTS as FRESH5
from tests.mutation.fresh6_mutants import MUTANTS as FRESH6
from tests.mutation.fresh7_mutants import MUTANTS as FRESH7
from tests.mutation.fresh8_mutants import MUTANTS as FRESH8
from tests.mutation.fresh9_mutants import MUTANTS as FRESH9
from tests.mutation.fresh10_mutants import MUTANTS as FRESH10
from tests.mutation.fresh11_mutants import MUTANTS as FRESH11
from tests.mutation.fresh12_mutants import MUTANTS as FRESH12
from tests.mutation.fresh13_mutants import MUTANTS as FRESH13
from tests.mutation.fresh14_mutants import MUTANTS as FRESH14
from tests.mutation.mutants import MUTANTS


def test_enough_mutants_in_every_area():
    areas = [m.area for m in MUTANTS]
    assert len(MUTANTS) >= 30 and {"metal", "python", "cpp"} <= set(areas)
    assert len({m.name for m in MUTANTS}) == len(MUTANTS), "mutant names must be unique"
    assert len({m.name for m in FRESH2}) == len(FRESH2) >= 20
    assert len({m.name for m in FRESH3}) == len(FRESH3) >= 40
    assert len({m.name for m in FRESH4}) == len(FRESH4) >= 40
    assert len({m.name for m in FRESH5}) == len(FRESH5) >= 40
    assert len({m.name for m in FRESH6}) == len(FRESH6) >= 40
    assert len({m.name for m in FRESH7}) == len(FRESH7) >= 40
    assert len({m.name for m in FRESH8}) == len(FRESH8) >= 25
    assert len({m.name for m in FRESH9}) == len(FRESH9) >= 25
    assert len({m.name for m in FRESH10}) == len(FRESH10) >= 25
    assert len({m.name for m in FRESH11}) == len(FRESH11) >= 12
    assert len({m.name for m in FRESH12}) == len(FRESH12) >= 12
    assert len({m.name for m in FRESH13}) == len(FRESH13) >= 15
    assert len({m.name for m in FRESH14}) == len(FRESH14) >= 20


@pytest.mark.parametrize("mutant", MUTANTS + FRESH2 + FRESH3 + FRESH4 + FRESH5 + FRESH6 + FRESH7 + FRESH8 + FRESH9 + FRESH10 + FRESH11 + FRESH12 + FRESH13 + FRESH14, ids=lambda m: m.name)
def test_mutant_applies_once_and_names_existing_tests(mutant):
    text = (ROOT / mutant.file).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.file}: the text to replace occurs {text.count(mutant.old)} times"
    assert mutant.new != mutant.old
    files = [a.split("::")[0] for a in mutant.tests if a.startswith("tests/")]
    assert files and all((Path(ROOT) / f).is_file() for f in files), mutant.tests
