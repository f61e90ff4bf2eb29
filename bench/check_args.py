"""Parse check for `CHECK=1 bash bench/run_all.sh`: parse a bench's command line without running it.

`python bench/check_args.py bench/X.py ARGS...` runs X.py as __main__ with ArgumentParser.parse_args
replaced: the arguments are parsed (unknown flags and bad values fail with argparse's own error, exit 2)
and the script stops right after, before it measures anything. A script with no argparse parser is only
compiled, and then must be given no arguments except the flags its source names literally.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path


class _Parsed(Exception):
    """Raised once the command line parsed: stop the script before it runs."""


def _parse_and_stop(self, args=None, namespace=None):
    _, extra = self.parse_known_args(args, namespace)
    if extra:
        self.error(f"unrecognized arguments: {' '.join(extra)}")
    raise _Parsed


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python bench/check_args.py bench/SCRIPT.py [ARGS...]", file=sys.stderr)
        return 2
    script, args = Path(sys.argv[1]), sys.argv[2:]
    source = script.read_text()
    if "argparse" not in source:
        compile(source, str(script), "exec")
        unknown = [a for a in args if a.startswith("-") and f'"{a}"' not in source and f"'{a}'" not in source]
        if unknown:
            print(f"{script}: has no parser and never names {' '.join(unknown)}", file=sys.stderr)
            return 2
        return 0
    sys.path.insert(0, str(script.resolve().parent.parent))
    argparse.ArgumentParser.parse_args = _parse_and_stop
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _Parsed:
        return 0
    print(f"{script}: ran to the end without parsing its arguments", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
