"""Every number-bearing table in README.md's "Measured" sections points to a result file that exists
and that bench/run_all.sh writes; and every line of run_all.sh names a bench or command that exists.

A table is a fenced block or a markdown table with a digit in it. Its citation is a
`bench/results/NAME` (or a bare NAME.txt/NAME.json that exists there) in the text since the previous
table of its subsection (heading included; back-to-back tables share it) or in the paragraph right
after it. README sections that a
pending section file in docs/readme/ replaces (same heading) are checked in that file instead: the lead
merges those files into README.md.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
_CITE = re.compile(r"bench/results/([\w{},.-]+\.(?:txt|json|smtrace))|`([\w-]+\.(?:txt|json))`")


def _expand(name: str) -> list[str]:
    """hotpath_speculative_{0,1,2}ms.txt -> three names."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [x for part in m.group(1).split(",") for x in _expand(name[:m.start()] + part + name[m.end():])]


def cited_files(text: str) -> list[str]:
    names = []
    for path, bare in _CITE.findall(text):
        if path:
            names += _expand(path)
        elif (RESULTS / bare).exists():
            names.append(bare)
    return names


def _subsections(markdown: str) -> list[tuple[str, list[str]]]:
    """(heading, lines) of every subsection of a level-2 section whose heading says "Measured", and of
    every heading that itself says "Measured"."""
    out, inside, current = [], False, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            inside = "Measured" in line
            current = (line, []) if inside else None
            if current:
                out.append(current)
            continue
        if line.startswith("### "):
            if inside or "Measured" in line:
                current = (line, [])
                out.append(current)
            else:
                current = None
            continue
        if current is not None:
            current[1].append(line)
    return out


def tables(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line index of each number-bearing table: fenced blocks and markdown tables."""
    spans, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if any(re.search(r"\d", l) for l in lines[i + 1:j]) and not lines[i].startswith(("```bash", "```python")):
                spans.append((i, j))
            i = j + 1
        elif lines[i].startswith("|"):
            j = i
            while j + 1 < len(lines) and lines[j + 1].startswith("|"):
                j += 1
            if any(re.search(r"\d", l) for l in lines[i + 2:j + 1]):
                spans.append((i, j))
            i = j + 1
        else:
            i += 1
    return spans


def uncited_tables(markdown: str) -> list[str]:
    """Headings (with the table's first line) of tables no result file is cited for."""
    bad = []
    for heading, lines in _subsections(markdown):
        prev_end, prev_context = -1, ""
        for first, last in tables(lines):
            between = lines[prev_end + 1:first]
            inherited = prev_context if not any(l.strip() for l in between) else ""  # back-to-back tables
            after = last + 1
            while after < len(lines) and not lines[after].strip():
                after += 1
            para_end = after
            while para_end < len(lines) and lines[para_end].strip() and not lines[para_end].startswith(("```", "|")):
                para_end += 1
            context = "\n".join([inherited, heading] + lines[prev_end + 1:last + 1] + lines[after:para_end])
            if not cited_files(context):
                bad.append(f"{heading} | {lines[first + 1 if lines[first].startswith('```') else first][:60]}")
            prev_end, prev_context = last, context
    return bad


def _pending_replacements() -> dict[str, str]:
    """Level-3 headings of docs/readme/*.md section files -> that section's text."""
    out = {}
    for f in sorted((ROOT / "docs" / "readme").glob("*.md")):
        text = f.read_text()
        for heading, lines in _subsections("## Measured here\n" + text):
            if heading.startswith("### "):
                out[heading] = "## Measured here\n" + heading + "\n" + "\n".join(lines)
    return out


def _readme_to_check() -> str:
    """README.md with the sections a pending docs/readme/ file replaces swapped for that file's text
    (section files' new sections are checked once merged)."""
    readme = (ROOT / "README.md").read_text()
    measured = {h for h, _ in _subsections(readme)}
    pending = {h: t for h, t in _pending_replacements().items() if h in measured}
    keep, skipping = [], False
    for line in readme.splitlines():
        if line.startswith("## ") or line.startswith("### "):
            skipping = line in pending
        if not skipping:
            keep.append(line)
    return "\n".join(keep) + "\n" + "\n".join(pending.values())


def run_all_outputs() -> set[str]:
    out = subprocess.run(["bash", str(ROOT / "bench" / "run_all.sh")], env={"LIST": "1", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return {Path(line).name for line in out.split()}


def test_the_table_parser_finds_tables_and_their_citations():
    md = ("## Measured here\n### A\n```\nx 1.0\n```\n### B (`bench/results/memory.txt`)\n```\ny 2\n```\n"
          "| a | b |\n|---|---|\n| 1 | 2 |\nfrom `hotpath.txt`\n## Other\n```\nz 3\n```\n")
    assert uncited_tables(md) == ["### A | x 1.0"]
    assert cited_files("`bench/results/hotpath_speculative_{0,1}ms.txt`") == [
        "hotpath_speculative_0ms.txt", "hotpath_speculative_1ms.txt"]


def test_every_measured_table_in_the_readme_cites_a_result_file():
    assert uncited_tables(_readme_to_check()) == []


def test_every_cited_result_file_exists_and_run_all_writes_it():
    cited = set(cited_files(_readme_to_check()))
    assert cited, "no result file cited at all: the parser is broken"
    missing = sorted(c for c in cited if not (RESULTS / c).exists())
    assert missing == []
    written = run_all_outputs()
    # A file that says on its first line that it is an earlier run (kept for comparison) is not re-run.
    archived = {c for c in cited if (RESULTS / c).exists() and (RESULTS / c).read_bytes().startswith(b"# earlier run")}
    assert sorted(cited - written - archived) == []


def test_run_all_lines_name_benches_and_flags_that_exist():
    """The cheap part of `CHECK=1 bash bench/run_all.sh`: each `python bench/X.py` exists and every flag it
    is given is declared in its source (the full check parses each line with the real parsers, ~5 min)."""
    text = (ROOT / "bench" / "run_all.sh").read_text()
    calls = re.findall(r"^\s*run \S+ python (bench/\S+\.py)([^\n]*)", text, re.M)
    assert len(calls) >= 20
    for script, args in calls:
        assert (ROOT / script).exists(), script
        source = (ROOT / script).read_text()
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", args):
            assert f'"{flag}"' in source, f"{script} does not declare {flag}"
