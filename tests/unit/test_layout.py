"""README's "Layout" block lists every package folder, one line each, and nothing that is not one.

A package folder is a folder holding an __init__.py under shoal/, peer/ or coordinator/ (the
source roots pyproject.toml maps), plus the repository's other top folders (TOP_FOLDERS). Pure:
reads files, starts nothing."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("shoal", "peer", "coordinator")
TOP_FOLDERS = ("protos", "tests", "docs", "deploy", "scripts", "examples")


def layout_entries(readme: str) -> list[str]:
    """The folders the first code block under "## Layout" names: the first word of each line."""
    section = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    assert section, 'README.md has no "## Layout" section'
    block = re.search(r"^```\n(.*?)^```", section.group(1), re.S | re.M)
    assert block, 'README.md\'s "## Layout" section has no code block'
    return [line.split()[0] for line in block.group(1).splitlines() if line.strip()]


def package_folders(root: pathlib.Path) -> set[str]:
    """Every folder with an __init__.py under the source roots, and the top folders, as "a/b/"."""
    found = {f"{name}/" for name in TOP_FOLDERS}
    for source in SOURCE_ROOTS:
        for init in (root / source).rglob("__init__.py"):
            found.add(init.parent.relative_to(root).as_posix() + "/")
    return found


def test_layout_lists_every_package_once_and_nothing_else():
    entries = layout_entries((ROOT / "README.md").read_text(encoding="utf-8"))
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    assert not repeated, f"listed more than once in README's Layout: {repeated}"
    listed, present = set(entries), package_folders(ROOT)
    assert not present - listed, f"packages README's Layout does not list: {sorted(present - listed)}"
    assert not listed - present, f"README's Layout lists what is no package here: {sorted(listed - present)}"


def test_every_top_folder_exists():
    missing = [name for name in TOP_FOLDERS if not (ROOT / name).is_dir()]
    assert not missing, missing


def test_the_check_sees_a_new_package_and_a_stale_line(tmp_path):
    (tmp_path / "shoal" / "extra").mkdir(parents=True)
    (tmp_path / "shoal" / "__init__.py").write_text("")
    (tmp_path / "shoal" / "extra" / "__init__.py").write_text("")
    (tmp_path / "shoal" / "data").mkdir()  # no __init__.py: not a package
    readme = "## Layout\n\n```\nshoal/   the root\nshoal/gone/   removed\n```\n\n## Next\n"
    assert package_folders(tmp_path) - {f"{name}/" for name in TOP_FOLDERS} == {"shoal/", "shoal/extra/"}
    assert layout_entries(readme) == ["shoal/", "shoal/gone/"]

