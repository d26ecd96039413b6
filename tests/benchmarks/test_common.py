"""benchmarks/common.py replace_section: each benchmark rewrites only its own section of docs/RESULTS.md."""

from __future__ import annotations

import pytest

from benchmarks.common import replace_section


def test_creates_the_file_with_a_heading_and_the_section(tmp_path):
    path = tmp_path / "docs" / "RESULTS.md"
    replace_section(path, "overhead", "## Overhead\n\n| a | b |\n")
    assert path.read_text() == "# Results\n\n<!-- overhead:start -->\n## Overhead\n\n| a | b |\n<!-- overhead:end -->\n"
    assert [p.name for p in path.parent.iterdir()] == ["RESULTS.md"]  # no partial file left behind


def test_appends_the_section_to_a_file_without_it(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\nkept\n\n\n")
    replace_section(path, "table1", "table one")
    assert path.read_text() == "# Results\n\nkept\n\n<!-- table1:start -->\ntable one\n<!-- table1:end -->\n"


def test_replaces_only_its_own_section(tmp_path):
    path = tmp_path / "RESULTS.md"
    before = "# Results\n\nintro\n\n<!-- table1:start -->\ntable one\n<!-- table1:end -->\n\nbetween\n\n"
    after = "\n\noutro\n"
    path.write_text(before + "<!-- overhead:start -->\nold numbers\nold table\n<!-- overhead:end -->" + after)
    replace_section(path, "overhead", "new numbers")
    assert path.read_text() == before + "<!-- overhead:start -->\nnew numbers\n<!-- overhead:end -->" + after
    replace_section(path, "table1", "table one, again")
    text = path.read_text()
    assert "<!-- table1:start -->\ntable one, again\n<!-- table1:end -->" in text
    assert "<!-- overhead:start -->\nnew numbers\n<!-- overhead:end -->" in text
    assert text.startswith("# Results\n\nintro\n\n") and text.endswith("\n\noutro\n") and "\nbetween\n" in text


def test_a_section_whose_name_extends_another_is_a_different_section(tmp_path):
    path = tmp_path / "RESULTS.md"
    replace_section(path, "table1", "one")
    replace_section(path, "table10", "ten")
    replace_section(path, "table1", "one, again")
    text = path.read_text()
    assert "<!-- table1:start -->\none, again\n<!-- table1:end -->" in text
    assert "<!-- table10:start -->\nten\n<!-- table10:end -->" in text


@pytest.mark.parametrize(
    "broken",
    [
        "<!-- overhead:start -->\nno end\n",
        "<!-- overhead:end -->\n<!-- overhead:start -->\n",
        "<!-- overhead:start -->\na\n<!-- overhead:end -->\n<!-- overhead:start -->\nb\n<!-- overhead:end -->\n",
    ],
)
def test_broken_markers_are_refused_and_the_file_is_left_alone(tmp_path, broken):
    path = tmp_path / "RESULTS.md"
    path.write_text(broken)
    with pytest.raises(ValueError, match="overhead"):
        replace_section(path, "overhead", "new")
    assert path.read_text() == broken


def test_refuses_text_with_its_own_markers_and_names_that_break_the_comment(tmp_path):
    path = tmp_path / "RESULTS.md"
    with pytest.raises(ValueError, match="contains its own marker"):
        replace_section(path, "overhead", "a\n<!-- overhead:end -->\nb")
    with pytest.raises(ValueError, match="section name"):
        replace_section(path, "over head -->", "text")
    assert not path.exists()
