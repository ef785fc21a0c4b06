#!/usr/bin/env python3
"""Compares two spikecube.json files but for what differs from run to run:
the same `timings_s` keys (their values are not compared), and everything
else equal once the timings, wall times and seconds (`*_s` entries, `wall`),
and the runs' own folders (`old/` and `new/` in paths) are masked. Exit 1 and the first
difference when they differ."""
import json
import sys


def masked(v, key=""):
    if isinstance(v, dict):
        return {
            k: ("<time>" if (k.endswith("_s") or k in ("wall", "wall_s", "elapsed")) and isinstance(x, (int, float)) else masked(x, k))
            for k, x in v.items()
            if k != "timings_s"
        }
    if isinstance(v, list):
        return [masked(x, key) for x in v]
    return v


def main():
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
    ka, kb = sorted(a.get("timings_s", {})), sorted(b.get("timings_s", {}))
    if ka != kb:
        print("timings_s keys differ:", sorted(set(ka) ^ set(kb)))
        sys.exit(1)
    ma, mb = json.dumps(masked(a), sort_keys=True, indent=1), json.dumps(masked(b), sort_keys=True, indent=1)
    # The two runs' folders are WORK/old/... and WORK/new/...
    ma = ma.replace("/old/", "/new/")
    if ma != mb:
        import difflib
        for line in list(difflib.unified_diff(ma.splitlines(), mb.splitlines(), lineterm=""))[:40]:
            print(line)
        sys.exit(1)


if __name__ == "__main__":
    main()
