"""docs/architecture.md's "The life of a cache slot" against runtime/cache/slot_table.py.

The doc's state list must equal the module's state constants; every SlotTable / ExpertCache method its
transition table names must exist; every SlotTable method that writes a slot's state must be named in the
table. The checkers are shown to fail on a planted method and a planted state.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

from runtime.cache import ExpertCache
from runtime.cache import slot_table
from runtime.cache.slot_table import SlotTable

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def _section() -> str:
    text = DOC.read_text()
    start = text.index("## The life of a cache slot")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def doc_states(section: str) -> set[str]:
    line = next(l for l in section.splitlines() if l.startswith("States"))
    return set(re.findall(r"`([A-Z_]+)`", line))


def doc_methods(section: str) -> set[str]:
    """Method names in the transition table's second and third columns (`name`, `Class.name`)."""
    names = set()
    for row in section.splitlines():
        cells = row.split("|")
        if len(cells) < 4 or "transition" in row or set(row) <= set("|- "):
            continue
        for cell in cells[2:4]:
            names |= {n.split(".")[-1] for n in re.findall(r"`([A-Za-z_.]+)`", cell)}
    return names


def code_states(module) -> set[str]:
    return {n for n, v in vars(module).items() if n.isupper() and isinstance(v, int) and not n.startswith("_")}


def state_writers(source: str, cls: str = "SlotTable") -> set[str]:
    """Methods of `cls` that assign into some `<x>.state[...]`."""
    tree = ast.parse(source)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if not isinstance(fn, ast.FunctionDef):
                    continue
                for sub in ast.walk(fn):
                    targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] \
                        if isinstance(sub, ast.AugAssign) else []
                    for t in targets:
                        if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "state":
                            out.add(fn.name)
    return out


def test_the_doc_lists_exactly_the_slot_states():
    assert doc_states(_section()) == code_states(slot_table) == {"FREE", "LOADING", "VALID"}


def test_every_method_the_doc_names_exists():
    names = doc_methods(_section())
    assert {"reserve", "commit", "abort", "trim", "set_usable", "clear", "hold", "release"} <= names
    missing = [n for n in names if not (hasattr(SlotTable, n) or hasattr(ExpertCache, n))]
    assert missing == []


def test_every_state_writing_method_is_in_the_doc():
    writers = state_writers(inspect.getsource(slot_table))
    assert writers >= {"reserve", "commit", "abort", "trim", "clear"}
    assert writers <= doc_methods(_section())


def test_the_checkers_catch_a_planted_transition_and_state():
    planted = inspect.getsource(slot_table) + textwrap.dedent("""
        class SlotTable(SlotTable):
            def evict_now(self, layer, slot):
                self.layers[layer].state[slot] = FREE
    """)
    assert "evict_now" in state_writers(planted)
    assert not state_writers(planted) <= doc_methods(_section())

    class Planted:
        FREE, LOADING, VALID, DRAINING = 0, 1, 2, 3

    assert code_states(Planted) != doc_states(_section())
