#!/usr/bin/env python3
"""Runs `betreefs kv-bench` for betreefs and RocksDB side by side.

Each configuration runs --repeat times, engines interleaved so machine noise
hits both alike; the table gives medians and the betreefs/RocksDB ratios.

  scripts/kv_compare.py --betreefs target/release/betreefs \
      --rocksdb /tmp/rocks-target/release/betreefs --repeat 3 --out docs/benchmarks/triad-ws.md

The RocksDB binary is the same tool built with `--features rocksdb` (see
docs/benchmarks/README.md).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

WS = [("ws1", 10), ("ws2", 10), ("ws3", 10), ("ws1", 50), ("ws2", 50), ("ws3", 50)]


def run(binary, engine, workload, reads, keys, ops, workdir, extra):
    path = os.path.join(workdir, f"{engine}.db")
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    cmd = [binary, "kv-bench", "--engine", engine, "--path", path, "--workload", workload,
           "--reads", str(reads), "--keys", str(keys), "--ops", str(ops)] + extra
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = [l for l in out.splitlines() if l.startswith("{")][-1]
    return json.loads(line), " ".join(cmd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--betreefs", required=True)
    ap.add_argument("--rocksdb", help="betreefs binary built with --features rocksdb")
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--ops", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/kv-compare")
    ap.add_argument("--workloads", default="ws", help="ws (TRIAD mixes) or fill (fillseq/fillrandom/readrandom/scan)")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    configs = WS if args.workloads == "ws" else [("fillseq", 0), ("fillrandom", 0), ("readrandom", 100), ("scan", 100)]
    engines = [("betreefs", args.betreefs)] + ([("rocksdb", args.rocksdb)] if args.rocksdb else [])
    rows = []
    commands = {}
    for workload, reads in configs:
        results = {e: [] for e, _ in engines}
        for _ in range(args.repeat):
            for engine, binary in engines:
                r, cmd = run(binary, engine, workload, reads, args.keys, args.ops, args.workdir, [])
                results[engine].append(r)
                commands[(engine, workload, reads)] = cmd
                print(json.dumps(r), file=sys.stderr, flush=True)
        rows.append((workload, reads, results))
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    lines = [
        f"Machine: {os.uname().nodename}, {os.cpu_count()} cores; date {time.strftime('%Y-%m-%d')}; "
        f"{args.keys} keys, {args.ops} ops, {args.repeat} runs each, medians.",
        "",
        "| workload | reads % | engine | kops/s | write amp. | steady write amp. | device GB written | device GB read | peak RSS MiB | seconds |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, reads, results in rows:
        for engine, _ in engines:
            rs = results[engine]
            lines.append(
                f"| {workload} | {reads} | {engine} | {med(rs, 'ops_per_sec') / 1000:.1f} | "
                f"{med(rs, 'write_amplification'):.2f} | {med(rs, 'write_amplification_steady'):.2f} | "
                f"{med(rs, 'device_bytes_written') / 1e9:.2f} | "
                f"{med(rs, 'device_bytes_read') / 1e9:.2f} | {med(rs, 'peak_rss_bytes') / 2**20:.0f} | "
                f"{med(rs, 'seconds'):.1f} |")
        if len(engines) == 2:
            b, r = results["betreefs"], results["rocksdb"]
            wa_r = med(r, "write_amplification")
            wa_ratio = med(b, "write_amplification") / wa_r if wa_r else float("nan")
            lines.append(
                f"| {workload} | {reads} | **ratio b/r** | **{med(b, 'ops_per_sec') / med(r, 'ops_per_sec'):.2f}×** | "
                f"**{wa_ratio:.2f}×** | | | | | |")
    lines += ["", "Commands (one of each):", "", "```"]
    lines += [commands[k] for k in sorted(commands)]
    lines += ["```"]
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
