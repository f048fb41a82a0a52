"""The README stays short enough to read in a minute, and the docs hold together: the README's length and line
widths, every relative link in README.md and docs/*.md resolves, the README's set-up commands are the two that
CI runs (.ci/run), and every `perfx <command>` the README shows is a real subcommand."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from perfx.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_LINES = 150
MAX_WIDTH = 300

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+\s+(.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/ (at most {MAX_LINES})"


def test_readme_lines_are_short():
    long = [(number, len(line)) for number, line in enumerate(README.read_text().splitlines(), 1)
            if len(line) > MAX_WIDTH]
    assert not long, f"README.md lines over {MAX_WIDTH} characters (line, length): {long}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = page.read_text()
    # Links inside code blocks are code, not links.
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files or headings: {broken}"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in DOCS if p.name != "README.md" and f"({p.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"


def test_readme_setup_commands_are_the_ones_ci_runs():
    text = README.read_text()
    section = text.split("## Set up and test", 1)[1].split("\n## ", 1)[0]
    (block,) = fenced_blocks(section, "sh")
    commands = [line.strip() for line in block.splitlines() if line.strip()]
    assert commands == ['pip install -e ".[dev]"', "python -m pytest -n auto"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert command in ci, f".ci/run does not run the README's {command!r}"


def test_readme_commands_are_real_subcommands():
    names = {name for name, *_ in COMMANDS}
    shown = set()
    for block in fenced_blocks(README.read_text(), "sh"):
        for line in block.splitlines():
            match = re.match(r"\s*perfx\s+(\S+)", line)
            if match:
                shown.add(match.group(1))
    for word in re.findall(r"`perfx (\w+)", README.read_text()):
        shown.add(word)
    assert shown, "the README shows perfx commands"
    assert shown <= names, f"not perfx subcommands: {sorted(shown - names)} (perfx has {sorted(names)})"
    assert {"generate", "chat", "serve", "info", "selftest", "tune", "bench", "perplexity"} <= shown


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_shown_command_lines_parse(page):
    """Every `perfx ...` line in a page's shell blocks is accepted by perfx's own parser as written."""
    parser = build_parser()
    bad = []
    for block in fenced_blocks(page.read_text(), "sh"):
        for line in block.splitlines():
            match = re.match(r"\s*perfx\s+(.*)", line)
            if not match:
                continue
            words = shlex.split(match.group(1).split("  #", 1)[0])
            try:
                parser.parse_args(words)
            except SystemExit:
                bad.append(line.strip())
    assert not bad, f"{page.relative_to(ROOT)}: perfx does not accept {bad}"
