#!/usr/bin/env python3
"""Lists the longest functions of the Rust sources: lines from a line that opens a
`fn` (after optional `pub`, `pub(crate)`, `async`, `unsafe`, `const`) to the first
line after it that is a lone `}` at the same indent.

Usage: python3 benches/fn_lengths.py [--max N] [DIR ...]   (default DIR: src)
Exits 1 when a function is longer than --max lines (default: no limit)."""
import re
import sys
from pathlib import Path

FN = re.compile(r"^(\s*)(pub(\([a-z]+\))?\s+)?((const|async|unsafe|extern \"C\")\s+)*fn\s+(\w+)")


def lengths(path):
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        indent = m.group(1)
        # A declaration without a body (trait method) ends in ';' before any '{'.
        j = i
        while j < len(lines) and "{" not in lines[j] and not lines[j].rstrip().endswith(";"):
            j += 1
        if j >= len(lines) or "{" not in lines[j]:
            continue
        if lines[j].rstrip().endswith("}"):
            out.append((1 + j - i, m.group(6), i + 1))
            continue
        for k in range(j + 1, len(lines)):
            if lines[k].rstrip() == indent + "}":
                out.append((k - i + 1, m.group(6), i + 1))
                break
    return out


def main():
    args = sys.argv[1:]
    limit = None
    if args[:1] == ["--max"]:
        limit = int(args[1])
        args = args[2:]
    rows = []
    for d in args or ["src"]:
        for p in sorted(Path(d).rglob("*.rs")):
            rows += [(n, f"{p}:{line} {name}") for n, name, line in lengths(p)]
    rows.sort(reverse=True)
    for n, where in rows[:15]:
        print(f"{n:5d}  {where}")
    if limit is not None and rows and rows[0][0] > limit:
        print(f"longer than {limit} lines: {sum(1 for n, _ in rows if n > limit)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
