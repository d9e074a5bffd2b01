"""docs/scale.md's figures are printed by ``refit plan --markdown``: the small model's block is
run again here and must match the page, and every block must name arguments ``refit plan``
takes."""

from __future__ import annotations

import re
from pathlib import Path

from refit.cli import scale_doc

PAGE = Path(__file__).resolve().parents[2] / "docs" / "scale.md"
SMALL = 64  # ranks: blocks up to this size are cheap enough to run in the suite


def test_every_block_is_well_formed():
    text = PAGE.read_text()
    found = scale_doc.blocks(text)
    assert len(found) >= 5
    opening = re.findall(r"^<!-- refit plan ", text, re.M)
    assert len(opening) == len(found) == len(re.findall(f"^{scale_doc.END}$", text, re.M))
    for b in found:
        assert scale_doc.world_of(b.args) > 0  # refit plan's own parser takes the arguments
        body = b.body(text)
        assert body.startswith("| plan |"), b.args  # generated, not left empty
    assert any(scale_doc.world_of(b.args) <= SMALL for b in found)


def test_the_small_models_figures_match_a_fresh_run():
    assert scale_doc.check(str(PAGE), SMALL) == []


def test_check_names_a_stale_block(tmp_path):
    text = PAGE.read_text()
    b = next(b for b in scale_doc.blocks(text) if scale_doc.world_of(b.args) <= SMALL)
    stale = text[:b.start] + b.body(text).replace("| no fan-out |", "| no fan-out (edited) |", 1) + "\n" + text[b.end:]
    page = tmp_path / "scale.md"
    page.write_text(stale)
    assert scale_doc.check(str(page), SMALL) == [" ".join(b.args)]
    assert scale_doc.update(str(page), SMALL) == 1
    assert scale_doc.check(str(page), SMALL) == []
