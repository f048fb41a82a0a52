"""The OpenCL C sources of every kernel family (installed as ``perfx.kernels``), and the one reader of their
text that tells code from comments: the tuning database pins a record to the code only (a comment may be
edited without making any record stale), and tests/test_comments.py reads the comments alone."""

from __future__ import annotations


def split_comments(text: str) -> tuple[str, list[tuple[int, str]]]:
    """(the code of an OpenCL C source with each comment replaced by a space, [(line, comment text)]).

    String and character literals are kept whole, so a ``//`` or ``/*`` inside one is code; a literal or a
    ``//`` comment ends at its line's end unless the line ends in a backslash (a continued line, as in C).
    A block comment's own newlines stay in the code, so the code's lines are the source's lines.
    """
    code: list[str] = []
    comments: list[tuple[int, str]] = []
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        two = text[i:i + 2]
        if two == "//" or two == "/*":
            start, start_line, block = i, line, two == "/*"
            i += 2
            while i < n:
                if block and text.startswith("*/", i):
                    i += 2
                    break
                if not block and text[i] == "\n" and text[i - 1] != "\\":
                    break
                i += 1
            else:
                if block:
                    raise ValueError(f"unterminated /* comment from line {start_line}")
            body = text[start + 2:i - 2 if block else i]
            comments.append((start_line, body))
            newlines = body.count("\n")
            line += newlines
            code.append(" " + "\n" * newlines if block else " ")
            if not block and newlines:   # a // comment continued over lines: keep the line count
                code.append("\n" * newlines)
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1 if j < n and text[j] == c else j, n)
            code.append(text[i:j])
            line += text[i:j].count("\n")
            i = j
            continue
        code.append(c)
        line += c == "\n"
        i += 1
    return "".join(code), comments


def code_only(text: str) -> str:
    """An OpenCL C source's code alone: comments removed, each line's whitespace runs made one space, blank
    lines dropped (lines are kept: a preprocessor directive ends at its line's end). Two sources with the same
    ``code_only`` compile to the same program."""
    code, _ = split_comments(text)
    lines = (" ".join(part.split()) for part in code.splitlines())
    return "\n".join(line for line in lines if line)
