"""``.gitignore`` patterns, as git reads them, for the files of one directory tree.

Rules are matched against a path relative to the tree's root (``/`` separated). The last
rule that matches decides; a ``!`` rule takes a path back in. As in git, nothing under an
excluded directory can be taken back in: the walk never enters it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    pattern: str  # as written, for messages
    regex: re.Pattern[str]
    negated: bool
    dir_only: bool


class IgnoreRules:
    """The rules of one or more ignore files, in the order they apply."""

    def __init__(self, rules: Iterable[Rule] = ()) -> None:
        self.rules = list(rules)

    @classmethod
    def parse(cls, text: str) -> IgnoreRules:
        return cls(rule for line in text.splitlines() if (rule := parse_line(line)) is not None)

    def __add__(self, other: IgnoreRules) -> IgnoreRules:
        return IgnoreRules([*self.rules, *other.rules])

    def ignored(self, path: str, is_dir: bool) -> bool:
        """Whether ``path`` (relative, ``/`` separated) is excluded."""
        verdict = False
        for rule in self.rules:
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.fullmatch(path):
                verdict = not rule.negated
        return verdict


def parse_line(line: str) -> Rule | None:
    """One line of an ignore file: None for a blank line or a comment."""
    text = _strip_trailing_spaces(line.rstrip("\r\n"))
    if not text or text.startswith("#"):
        return None
    negated = text.startswith("!")
    if negated or text.startswith("\\!") or text.startswith("\\#"):
        text = text[1:]
    dir_only = text.endswith("/")
    body = text.rstrip("/")
    if not body:
        return None
    # A slash at the start or in the middle anchors the pattern at the root; without one
    # it matches at any depth.
    anchored = "/" in body
    body = body.lstrip("/")
    prefix = "" if anchored else "(?:.*/)?"
    return Rule(line.strip(), re.compile(prefix + translate(body)), negated, dir_only)


def _strip_trailing_spaces(text: str) -> str:
    # Trailing spaces are dropped unless escaped with a backslash ("foo\ ").
    end = len(text)
    while end > 0 and text[end - 1] == " " and not (end > 1 and text[end - 2] == "\\"):
        end -= 1
    return text[:end]


def translate(pattern: str) -> str:
    """A regular expression for one glob (``*``, ``?``, ``[...]``, ``**``), matched against a
    whole relative path."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            j = i
            while j < n and pattern[j] == "*":
                j += 1
            whole_component = (i == 0 or pattern[i - 1] == "/") and (j == n or pattern[j] == "/")
            if j - i >= 2 and whole_component:
                if j == n:
                    out.append(".*")  # "dir/**": everything inside
                    i = j
                else:
                    out.append("(?:.*/)?")  # "**/" : zero or more directories
                    i = j + 1
                continue
            out.append("[^/]*")
            i = j
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end, cls = _char_class(pattern, i)
            out.append(cls)
            i = end
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def _char_class(pattern: str, start: int) -> tuple[int, str]:
    """(the index after the class, its regex) for the ``[`` at ``start``; an unclosed ``[``
    is a literal bracket."""
    i = start + 1
    negate = i < len(pattern) and pattern[i] in "!^"
    if negate:
        i += 1
    first = i
    while i < len(pattern) and (pattern[i] != "]" or i == first):
        i += 1
    if i >= len(pattern):
        return start + 1, re.escape("[")
    members = pattern[first:i].replace("\\", "\\\\").replace("[", "\\[")
    if members.startswith("^"):
        members = "\\" + members
    # A negated class still never matches the separator.
    return i + 1, f"[^/{members}]" if negate else f"[{members}]"
