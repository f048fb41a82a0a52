"""The OpenCL C sources of every kernel family (installed as ``perfx.kernels``), and the one reader of their
text that tells code from comments: the tuning database pins a record to the code only (a comment may be
edited without making any record stale), and tests/test_comments.py reads the comments alone."""

from __future__ import annotations

import re


# A comment, or a literal (kept whole as code): a // comment runs to a line's end not escaped by a backslash; a
# literal to its closing quote or its line's end, a backslash escaping the next character.
_TOKENS = re.compile(r"""(//(?:\\\n|[^\n])*)|(/\*.*?\*/)|(/\*)|("(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?)""",
                     re.S)


def split_comments(text: str) -> tuple[str, list[tuple[int, str]]]:
    """(the code of an OpenCL C source with each comment replaced by a space, [(line, comment text)]).

    String and character literals are kept whole, so a ``//`` or ``/*`` inside one is code; a literal or a
    ``//`` comment ends at its line's end unless the line ends in a backslash (a continued line, as in C).
    A block comment's own newlines stay in the code, so the code's lines are the source's lines.
    """
    code: list[str] = []
    comments: list[tuple[int, str]] = []
    done, line = 0, 1
    for match in _TOKENS.finditer(text):
        start = match.start()
        code.append(text[done:start])
        line += text.count("\n", done, start)
        line_comment, block, unterminated, _ = match.groups()
        if unterminated is not None:
            raise ValueError(f"unterminated /* comment from line {line}")
        if line_comment is None and block is None:   # a literal: code
            code.append(match.group())
            line += match.group().count("\n")
        else:
            body = line_comment[2:] if line_comment is not None else block[2:-2]
            comments.append((line, body))
            newlines = body.count("\n")
            line += newlines
            code.append(" " + "\n" * newlines)
        done = match.end()
    code.append(text[done:])
    return "".join(code), comments


def code_only(text: str) -> str:
    """An OpenCL C source's code alone: comments removed, each line's whitespace runs made one space, blank
    lines dropped (lines are kept: a preprocessor directive ends at its line's end). Two sources with the same
    ``code_only`` compile to the same program."""
    code, _ = split_comments(text)
    lines = (" ".join(part.split()) for part in code.splitlines())
    return "\n".join(line for line in lines if line)
