#!/usr/bin/env python3
"""table.py RUNS.jsonl: a markdown table of run.sh's runs, one row per build, flags and
thread count: each figure the median of the rounds (ops/s, then gets' p99.9 and longest,
puts' p99, p99.9 and longest, in ms)."""
import json, statistics, sys

runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
rows = {}
for r in runs:
    rows.setdefault((r['build'], r['flags'], r['threads']), []).append(r)
ms = lambda ns: ns / 1e6
print('| build | flags | threads | rounds | ops/s | get p99.9 / max, ms | put p99 / p99.9 / max, ms |')
print('|---|---|---:|---:|---:|---|---|')
for (build, flags, threads), rs in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
    med = lambda f: statistics.median(f(r) for r in rs)
    g = lambda k: med(lambda r: ms(r['get_latency'][k]))
    p = lambda k: med(lambda r: ms(r['put_latency'][k]))
    print(f"| {build} | {flags or '—'} | {threads} | {len(rs)} | {med(lambda r: r['ops_per_sec']):,.0f} "
          f"| {g('p999_nanos'):.2f} / {g('max_nanos'):.1f} | {p('p99_nanos'):.3f} / {p('p999_nanos'):.2f} / {p('max_nanos'):.1f} |")
