"""Every measured number in README.md and docs/benchmarks.md has a result file behind it.

- Every number-bearing table of docs/benchmarks.md, and the README's headline table, cites a
  `bench/results/NAME` (or a bare NAME.txt/NAME.json that exists there). A table's citation is in the
  text since the previous table of its section (heading included; back-to-back tables share it) or in
  the paragraph right after it.
- Every result file cited anywhere in README.md or docs/*.md exists, and bench/run_all.sh writes it
  (unless the file says on its first line that it is an earlier run kept for comparison).
- Where a citation carries a date ("memory.txt`, 2026-12-02" or "(bench/results/memory.txt) (2026-12-02"),
  it is the date the file's first line records, when the file records one.
- Every line of run_all.sh names a bench or command that exists.
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


def _subsections(markdown: str, wanted) -> list[tuple[str, list[str]]]:
    """(heading, lines) of every level-2 section whose heading `wanted(heading)` accepts, split at its
    level-3 headings."""
    out, inside, current = [], False, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            inside = wanted(line)
            current = (line, []) if inside else None
            if current:
                out.append(current)
            continue
        if line.startswith("### ") and inside:
            current = (line, [])
            out.append(current)
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


def uncited_tables(markdown: str, wanted=lambda heading: "Measured" in heading) -> list[str]:
    """Headings (with the table's first line) of tables no result file is cited for."""
    bad = []
    for heading, lines in _subsections(markdown, wanted):
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


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _benchmarks() -> str:
    return (ROOT / "docs" / "benchmarks.md").read_text()


def _all_docs() -> str:
    return "\n".join(f.read_text() for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def _headline(heading: str) -> bool:
    return "Headline measurements" in heading


def _any_but_method(heading: str) -> bool:
    return "How to read" not in heading


_DATE_AFTER = re.compile(r"^(?:\]\([^)\s]*\))?[`*]*[,;]?\s*\(?(\d{4}-\d{2}-\d{2})")
_FILE_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})T\d{2}:\d{2}Z|\((\d{4}-\d{2}-\d{2}) \d{2}:\d{2} UTC\)|; (\d{4}-\d{2}-\d{2})$")


def dated_citations(text: str) -> list[tuple[str, str]]:
    """(file name, date) for every citation followed by a date: `memory.txt`, 2026-12-02 or
    [memory.txt](bench/results/memory.txt) (2026-12-02, ...)."""
    out = []
    for m in re.finditer(r"([\w{},.-]+\.(?:txt|json|smtrace))", text):
        d = _DATE_AFTER.match(text[m.end():m.end() + 80])
        if d:
            out += [(name, d.group(1)) for name in _expand(Path(m.group(1)).name)]
    return out


def file_date(name: str) -> str | None:
    """The date a result file's first line records, if it records one."""
    path = RESULTS / name
    if not path.exists() or path.suffix not in (".txt",):
        return None
    first = path.read_text(errors="replace").split("\n", 1)[0]
    m = _FILE_DATE.search(first)
    return next((g for g in m.groups() if g), None) if m else None


def run_all_outputs() -> set[str]:
    out = subprocess.run(["bash", str(ROOT / "bench" / "run_all.sh")], env={"LIST": "1", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return {Path(line).name for line in out.split()}


def test_the_table_parser_finds_tables_and_their_citations():
    md = ("## Measured here\n### A\n```\nx 1.0\n```\n### B (`bench/results/memory.txt`)\n```\ny 2\n```\n"
          "| a | b |\n|---|---|\n| 1 | 2 |\nfrom `hotpath.txt`\n## Other\n```\nz 3\n```\n")
    assert uncited_tables(md) == ["### A | x 1.0"]
    assert uncited_tables(md, lambda heading: True) == ["### A | x 1.0", "## Other | z 3"]
    assert cited_files("`bench/results/hotpath_speculative_{0,1}ms.txt`") == [
        "hotpath_speculative_0ms.txt", "hotpath_speculative_1ms.txt"]


def test_the_date_parser_reads_both_citation_forms():
    text = ("[memory.txt](bench/results/memory.txt) (2026-12-02, 0.8) and `bench/results/speculative_emulated_{1,2}ms.txt`,"
            " 2026-12-03, load 1; `hotpath_decode.txt`\n(2026-12-04, 1.0); `tune.txt` says nothing")
    assert dated_citations(text) == [("memory.txt", "2026-12-02"), ("speculative_emulated_1ms.txt", "2026-12-03"),
                                     ("speculative_emulated_2ms.txt", "2026-12-03"), ("hotpath_decode.txt", "2026-12-04")]
    assert file_date("memory.txt") is not None
    stale = "[memory.txt](bench/results/memory.txt) (2020-01-01, 0.8)"
    assert [(n, d) for n, d in dated_citations(stale) if file_date(n) not in (None, d)] == [("memory.txt", "2020-01-01")]


def test_the_readme_headline_table_cites_a_result_file_on_every_row():
    sections = _subsections(_readme(), _headline)
    assert sections, "README.md has no 'Headline measurements' section"
    rows = [line for _, lines in sections for line in lines if line.startswith("|") and re.search(r"\d", line)]
    assert len(rows) >= 5
    assert [row[:60] for row in rows if not cited_files(row)] == []
    assert uncited_tables(_readme(), _headline) == []


def test_every_table_in_the_benchmarks_page_cites_a_result_file():
    assert uncited_tables(_benchmarks(), _any_but_method) == []


def test_the_dates_beside_citations_are_the_files_own():
    wrong = sorted({(name, date, file_date(name)) for name, date in dated_citations(_all_docs())
                    if file_date(name) not in (None, date)})
    assert wrong == []


def test_every_cited_result_file_exists_and_run_all_writes_it():
    cited = set(cited_files(_all_docs()))
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
