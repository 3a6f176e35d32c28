"""Append-only JSON-lines files (history.jsonl) that survive a writer killed mid-line.

A learner killed while writing a record leaves a last line without its newline, cut anywhere.
The writer cuts such a tail off before it appends (the next record would otherwise be glued
onto it and both lost); readers skip a line that does not decode, with one warning, instead
of failing: the record of a step that was not finished is worth less than the run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("gspo.jsonl")


def cut_partial_tail(path: Path) -> int:
    """Truncate `path` after its last newline; the bytes removed (0 when it ends whole)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return 0
        keep, block = 0, 1 << 16
        end = size
        while end > 0:  # search backwards for the last newline
            start = max(0, end - block)
            f.seek(start)
            at = f.read(end - start).rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            end = start
        f.truncate(keep)
        return size - keep


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON line at the end of `path`, after cutting a partial last line a killed writer
    left (logged once: which step's record was lost is in the lines before it)."""
    cut = cut_partial_tail(path)
    if cut:
        log.warning(
            "%s ended in a partial line (%d bytes, a writer killed mid-line); cut before appending",
            path,
            cut,
        )
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def decode_lines(lines: list[str], where: str, first_line: int = 1) -> list[dict[str, Any]]:
    """The records of complete `lines` (the first is line `first_line` of `where`); one that
    does not decode to an object is skipped with a warning naming its file and line."""
    out = []
    for n, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            log.warning(
                "%s line %d is not a JSON record (a writer killed mid-line?); skipped", where, n
            )
            continue
        out.append(record)
    return out


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of `path` ([] when it does not exist), skipping undecodable lines."""
    if not path.exists():
        return []
    return decode_lines(path.read_text(encoding="utf-8", errors="replace").splitlines(), str(path))
