"""The docs say what the code does (fast: no server).

Convention for a default named in prose (README.md and docs/*.md; docs/options.md is generated):
write it right after the flag as "`--tokendance-foo` (default 16)" -- a number, `on` / `off`, or
a string in backticks -- or in a table with a `flag` and a `default` column. Every such default
must be the `TokenDanceArgs` field's (a `--no-tokendance-foo` flag names the negated field), and a
flag followed by a bare "(16)" is refused, so a default is never written another way. Also:
docs/options.md is what `python -m sglang_tokendance.server_args` prints, and every relative link
in those pages reaches an existing file and, for an #anchor, an existing heading."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import runpy
from pathlib import Path

import pytest

from sglang_tokendance.server_args import TokenDanceArgs, flag_of

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "docs" / "options.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIELDS = {flag_of(f): f for f in dataclasses.fields(TokenDanceArgs)}

FLAG = r"--(?:no-)?tokendance-[a-z0-9-]+|--disable-tokendance"
# "`--flag`" or "`--flag ARG`", then, across a line break too, "(default X)" (booleans also "(on by default)")
INLINE = re.compile(rf"`({FLAG})(?: [^`]*)?`\s+\((?:default\s+(`[^`]+`|[^\s`),;:]+)|(on|off) by default)")
# a default written another way: "`--flag` (16)", "`--flag`, default 16"
OTHER = re.compile(rf"`({FLAG})(?: [^`]*)?`(?:\s+\((-?[0-9][0-9.]*)\)|,\s+default\s+(`[^`]+`|[^\s`),;:]+))")
FENCE = re.compile(r"^\s*```")


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def matches(pattern: re.Pattern, text: str) -> list[tuple[int, re.Match]]:
    """(line number, match) of `pattern` in the prose of `text`, matches spanning lines included."""
    kept = dict(prose(text))
    blanked = "\n".join(kept.get(n, "") for n in range(1, len(text.splitlines()) + 1))
    return [(blanked.count("\n", 0, m.start()) + 1, m) for m in pattern.finditer(blanked)]


def cells(line: str) -> list[str]:
    """A Markdown table row's cells, `\\|` unescaped."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def written_defaults(text: str) -> list[tuple[int, str, str]]:
    """(line, flag, default as written) of every default the text names by the convention."""
    found = [(n, m.group(1), m.group(2) or m.group(3)) for n, m in matches(INLINE, text)]
    columns = None
    for number, line in prose(text):
        if not line.lstrip().startswith("|"):
            columns = None
            continue
        row = cells(line)
        if columns is None:  # a table's header: does it have a flag and a default column?
            names = [c.lower() for c in row]
            columns = (names.index("flag"), names.index("default")) if {"flag", "default"} <= set(names) else ()
        elif columns and not set(line) <= set("|-: "):
            flag = re.search(rf"`({FLAG})", row[columns[0]])
            if flag:
                found.append((number, flag.group(1), row[columns[1]]))
    return found


def mismatch(flag: str, written: str) -> str | None:
    """Why `written` is not `flag`'s default (None: it is)."""
    negated = flag.startswith("--no-")
    field = FIELDS.get("--" + flag[len("--no-"):] if negated else flag)
    if field is None:
        return f"{flag} is no option"
    value, default = written.strip().strip("`"), field.default
    if isinstance(default, bool):
        if value not in ("on", "off"):
            return f"{flag}: write on or off, not {written!r}"
        return None if (value == "on") == (default != negated) else f"{flag} is {'off' if value == 'on' else 'on'}"
    if isinstance(default, (int, float)):
        try:
            return None if float(value) == default else f"{flag} defaults to {default}, not {value}"
        except ValueError:
            return f"{flag}: {written!r} is not a number"
    return None if value == default else f"{flag} defaults to {default!r}, not {value!r}"


def errors_in(text: str) -> list[str]:
    errors = [f"line {n}: {why}" for n, flag, written in written_defaults(text) if (why := mismatch(flag, written))]
    errors += [f"line {n}: write `{m.group(1)}` (default {m.group(2) or m.group(3)})" for n, m in matches(OTHER, text)]
    return errors


@pytest.mark.parametrize("page", [p for p in PAGES if p != GENERATED], ids=lambda p: p.name)
def test_every_default_the_page_names_is_the_codes(page):
    assert errors_in(page.read_text()) == []


def test_the_readme_names_its_key_defaults():
    named = {flag for _, flag, _ in written_defaults((ROOT / "README.md").read_text())}
    assert len(named) >= 8, named  # the key options table (and prose) is parsed, not skipped


def test_a_wrong_default_is_caught():
    good = ("`--tokendance-check-layer` (default 8), `--tokendance-storage` (default `auto`),\n"
            "`--tokendance-round-leader` (default on), `--no-tokendance-cost-check` (default off),\n"
            "`--tokendance-diff-threshold ε` (default 0, off).\n\n"
            "| flag | default | meaning |\n|---|---|---|\n| `--tokendance-separator` | `<\\|tokendance_sep\\|>` | x |\n"
            "| `--tokendance-recompute-ratio` | 0.3 | y |\n")
    assert len(written_defaults(good)) == 7 and errors_in(good) == []
    for right, wrong in [("(default 8)", "(default 5)"), ("(default `auto`)", "(default `dense`)"),
                         ("(default on)", "(default off)"), ("(default off)", "(default on)"), ("| 0.3 |", "| 0.5 |"),
                         ("`<\\|tokendance_sep\\|>`", "`<\\|sep\\|>`"), ("(default 0, off)", "(default 0.1, off)")]:
        assert len(errors_in(good.replace(right, wrong))) == 1, wrong
    assert errors_in("`--tokendance-min-segment-tokens` (16)") == [
        "line 1: write `--tokendance-min-segment-tokens` (default 16)"]
    assert errors_in("a\n(`--tokendance-check-layer`, default 8)") == [
        "line 2: write `--tokendance-check-layer` (default 8)"]
    assert errors_in("x `--tokendance-check-layer`\n(default 5) and `--tokendance-keep-rows` (off by default)") == [
        "line 1: --tokendance-check-layer defaults to 8, not 5", "line 2: --tokendance-keep-rows is on"]
    assert errors_in("`--tokendance-no-such-flag` (default 1)") == ["line 1: --tokendance-no-such-flag is no option"]
    assert errors_in("```\n`--tokendance-check-layer` (default 5)\n```") == []  # code blocks are not prose


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy: the package imported it
def test_options_page_is_what_the_module_prints():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_module("sglang_tokendance.server_args", run_name="__main__")
    assert GENERATED.read_text() == printed.getvalue(), "python -m sglang_tokendance.server_args > docs/options.md"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Its headings' anchors (a repeated heading's: -1, -2, ...)."""
    found, repeats = set(), {}
    for _, line in prose(page.read_text()):
        if heading := re.match(r"#{1,6} (.+)", line):
            base = slug(heading.group(1))
            found.add(f"{base}-{repeats[base]}" if base in repeats else base)
            repeats[base] = repeats.get(base, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for number, line in prose(page.read_text()):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if "shared" in Path(path).parts or not file.exists():
                broken.append(f"{page.name}:{number}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}:{number}: no heading #{anchor} in {file.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_reach_a_file_and_heading(page):
    assert broken_links(page) == []


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## Master–Mirror storage (`x`)\n"
                                   "[ok](#top) [ok](b.md#mastermirror-storage-x)\n"
                                   "[gone](c.md) [no heading](b.md#nowhere) [web](https://example.com/x.md)\n")
    (tmp_path / "b.md").write_text("## Master–Mirror storage (`x`)\n")
    assert broken_links(tmp_path / "a.md") == ["a.md:4: c.md", "a.md:4: no heading #nowhere in b.md"]
