"""Code comments say why, never when, on which machine or how fast: no comment or docstring of the package, the
tuning specs or the kernels names a date, one of the machines the figures were measured on, a compiler's version
or a measured figure (those live in benchmarks/NOTES.md, dated, beside how they were measured)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from perfx.kernels import split_comments

ROOT = Path(__file__).resolve().parent.parent

# What a comment must not say, each with what it is.
PATTERNS = (
    ("a date", re.compile(r"\b(19|20)\d\d-(0[1-9]|1[0-2])(-\d\d)?\b")),
    ("a machine", re.compile(r"\b(zen ?\d|epyc|xeon|ryzen|threadripper|h100|h200|a100|core i\d|"
                             r"sapphire rapids|ice lake|skylake|avx2|avx-?512|this (vm|machine|box|host)|\d+-core)\b", re.I)),
    ("a compiler version", re.compile(r"\b(llvm|clang|gcc|pocl|cuda|oneapi|mesa|rusticl|icx|oclgrind|driver)"
                                      r"(?: version)? ?\(?v?\d+(\.\d+)*\b|\b20\d\d\.\d+(\.\d+)*\b", re.I)),
    ("a timing", re.compile(r"(?<![\w.])\d[\d,]*(\.\d+)? ?((µs|us|ms|ns)\b|(gb|gib|mb|gflop|tflop|tok|tokens)/s|"
                            r"[x×] (faster|slower|quicker))", re.I)),
    ("a timing", re.compile(r"(?<![\w.,])\d+(\.\d+)? (s|seconds|minutes)\b", re.I)),
)


def python_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment (tokenize's COMMENT tokens) and docstring (ast) of a Python source."""
    found = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(text).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                found.append((first.lineno, first.value.value))
    return found


def c_comments(text: str) -> list[tuple[int, str]]:
    return split_comments(text)[1]


def offending(comments: list[tuple[int, str]]) -> list[tuple[int, str, str]]:
    """(line, what, the words) of each comment line that says what a comment must not."""
    bad = []
    for start, comment in comments:
        for offset, line in enumerate(comment.splitlines() or [""]):
            for what, pattern in PATTERNS:
                match = pattern.search(line)
                if match:
                    bad.append((start + offset, what, match.group(0)))
    return bad


def scanned_files() -> list[Path]:
    files = sorted((ROOT / "perfx").rglob("*.py")) + sorted((ROOT / "tuning").glob("*.py"))
    return files + sorted((ROOT / "kernels").glob("*.py")) + sorted((ROOT / "kernels").glob("*.cl")) + \
        sorted((ROOT / "kernels").glob("*.h"))


def problems(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    comments = python_comments(text) if path.suffix == ".py" else c_comments(text)
    return [f"{path.relative_to(ROOT)}:{line}: {what} ({words!r})" for line, what, words in offending(comments)]


def test_no_comment_names_a_date_machine_compiler_version_or_timing():
    found = [problem for path in scanned_files() for problem in problems(path)]
    assert not found, "comments say why, not when, where or how fast (move the fact to benchmarks/NOTES.md):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("comment, what", [
    ("# measured 2026-12-04", "a date"), ("# 8 wide on Zen 4", "a machine"), ("# slow on this VM", "a machine"),
    ("# EPYC's L2", "a machine"), ("# the H200 runs it", "a machine"), ("# LLVM 14 fails here", "a compiler version"),
    ("# PoCL 3.0 cannot", "a compiler version"),
    ("# Intel's compiler (2026.2) crashes", "a compiler version"),
    ("# Oclgrind (21.10) crashes", "a compiler version"), ("# spills on AVX2", "a machine"), ("# costs 0.1 µs a group", "a timing"), ("# 12 ms a step", "a timing"),
    ("# reaches 40 GB/s", "a timing"), ("# 30 tok/s", "a timing"), ("# 2.5x faster", "a timing"),
    ("# ~20 s to compile", "a timing"),
])
def test_the_scanner_finds_a_planted_comment(tmp_path, comment, what):
    """Each kind is found in a Python comment, a docstring and a C comment, named by file and line."""
    words = comment[2:]
    sources = {"m.py": f'"""A module."""\n\nx = 1\n{comment}\n',
               "d.py": f'def f():\n    """Fine.\n\n    {words}\n    """\n',
               "k.cl": f'#define X "// {words} is a string, not a comment"\nint x; /* fine\n   {words} */\n'}
    lines = {"m.py": 4, "d.py": 4, "k.cl": 3}
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
        comments = python_comments(text) if name.endswith(".py") else c_comments(text)
        assert [(line, kind) for line, kind, _ in offending(comments)] == [(lines[name], what)], (name, text)


def test_the_scanner_passes_timeless_comments():
    fine = ['"""GB/s and GFLOP/s of each record; 8 wide: some CPU compilers fail to select 16-wide code."""',
            "# Adreno's 32 KiB of local memory; waves of 64 or 128; PoCL and Intel's CPU runtime both build it",
            "# a work-group costs its dispatch on a CPU; the M bucket (17, 64); sha256 of the code"]
    for text in fine:
        assert offending(python_comments(text + "\n")) == [], text


def test_the_c_reader_keeps_literals_and_lines():
    """A // or /* inside a string or character literal is code; a block comment's lines stay in the code, so
    the comments' line numbers are the source's; code_only drops comments, blank lines and whitespace runs."""
    from perfx.kernels import code_only
    text = ('#error "no // comment /* here"\nchar c = \'/\'; int d = 2 /* two\n lines */ ;  // the end\n'
            "#define A 1 // a comment that goes \\\n   on\nint e;\n")
    code, comments = split_comments(text)
    assert comments == [(2, " two\n lines "), (3, " the end"), (4, " a comment that goes \\\n   on")]
    assert code.count("\n") == text.count("\n")
    assert code_only(text) == '#error "no // comment /* here"\nchar c = \'/\'; int d = 2\n;\n#define A 1\nint e;'
    with pytest.raises(ValueError, match="unterminated"):
        split_comments("int x; /* never closed")
