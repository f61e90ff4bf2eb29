"""Read plans: an expert's byte ranges cut into pieces that several I/O threads read at once.

A piece is a short list of positioned reads that one thread does in order. plan_pieces() keeps each range
whole when it fits in piece_bytes, gathers consecutive whole ranges into one piece while the piece stays
within piece_bytes, and cuts a longer range into piece_bytes-long reads, each its own piece. With 512 KiB
pieces an expert of gpt-oss-20b (13 MB in nine ranges) becomes 27 pieces; one of Qwen3-30B-A3B (2.9 MB in
nine ranges) becomes nine.

Invariants: the reads of all pieces write every byte of the caller's views exactly once, in order; a read's
views are slices of the caller's buffers (nothing is copied); a read never spans two ranges; no piece is
empty and none holds more than piece_bytes unless piece_bytes is None (one piece: every range in order).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PieceRead:
    path: str  # file to read
    offset: int  # absolute byte offset in the file
    views: list  # destination memoryviews (uint8), filled in order
    nbytes: int  # bytes this read fills


def _cut(views: list, start: int, n: int) -> list:
    """Slices of the uint8 memoryviews `views` (one run of bytes) covering [start, start + n)."""
    out = []
    for v in views:
        if n == 0:
            break
        if start >= len(v):
            start -= len(v)
            continue
        take = min(len(v) - start, n)
        out.append(v[start : start + take])
        start, n = 0, n - take
    return out


def plan_pieces(reads: list[tuple[str, int, list]], piece_bytes: int | None) -> list[list[PieceRead]]:
    """Pieces for `reads`: (path, offset, views) triples whose views, concatenated, are the bytes at offset."""
    pieces: list[list[PieceRead]] = []
    current: list[PieceRead] = []
    room = piece_bytes
    for path, offset, views in reads:
        mvs = [memoryview(v).cast("B") for v in views]
        total = sum(len(v) for v in mvs)
        if piece_bytes is None or total <= piece_bytes:
            if current and piece_bytes is not None and total > room:
                pieces.append(current)
                current, room = [], piece_bytes
            current.append(PieceRead(path, offset, mvs, total))
            room = None if piece_bytes is None else room - total
            continue
        if current:
            pieces.append(current)
            current, room = [], piece_bytes
        for start in range(0, total, piece_bytes):
            n = min(piece_bytes, total - start)
            pieces.append([PieceRead(path, offset + start, _cut(mvs, start, n), n)])
    if current:
        pieces.append(current)
    return pieces
