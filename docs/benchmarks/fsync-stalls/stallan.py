# stallan.py PROBE_OUTPUT [N]: for the N (6) slowest write + fsync calls that
# probe.sh printed, what the loop device and the disk below it did in 5 ms
# steps over the call (io.txt in the working directory): MB/s written, requests
# in flight (flushes are not counted there), flushes completed.
import re, sys
rows = [list(map(float, l.split())) for l in open('io.txt')]
L, V = 1, 9  # each device's eight columns after the time
slow = [(float(m.group(1)), float(m.group(2)))
        for m in re.finditer(r"slow fsync at ([\d.]+): ([\d.]+) ms", open(sys.argv[1]).read())]
a, b = rows[0], rows[-1]
print(f"run: {b[0] - a[0]:.1f} s, loop flushes {b[L + 4] - a[L + 4]:.0f}, disk flushes {b[V + 4] - a[V + 4]:.0f}, "
      f"disk MB written {(b[V + 2] - a[V + 2]) * 512 / 1e6:.0f}, disk discards {b[V + 6] - a[V + 6]:.0f}")
for end, ms in sorted(slow, key=lambda s: -s[1])[:int(sys.argv[2]) if len(sys.argv) > 2 else 6]:
    print(f"-- write + fsync of {ms:.1f} ms ending at {end:.3f}")
    prev = None
    for r in rows:
        if end - ms / 1e3 - 0.01 <= r[0] <= end + 0.005:
            if prev:
                dt = r[0] - prev[0]
                mbs = lambda c: (r[c + 2] - prev[c + 2]) * 512 / dt / 1e6
                print(f"  {r[0] - end:+.3f} s  loop: {mbs(L):5.0f} MB/s in flight {int(r[L + 3]):2d} flushes {int(r[L + 4] - prev[L + 4]):3d}"
                      f" | disk: {mbs(V):5.0f} MB/s in flight {int(r[V + 3]):2d} flushes {int(r[V + 4] - prev[V + 4]):3d}")
            prev = r
