#!/usr/bin/env python3
# linkloop.py DIR SIZE N: N times, a fresh file of SIZE random bytes written and
# fsync'd, its directory fsync'd, then a hard link to it and an fsync of the
# directory timed together (the benchmark's "first link" row); both names
# removed after. Prints the median and the first 20 times in ms.
import os, sys, time, statistics
d, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def fsync_dir(p):
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY); os.fsync(fd); os.close(fd)
times = []
for i in range(n):
    a = os.path.join(d, f'l{i}'); b = a + 's'
    with open(a, 'wb') as f:
        f.write(os.urandom(size)); f.flush(); os.fsync(f.fileno())
    fsync_dir(d)
    t0 = time.perf_counter(); os.link(a, b); fsync_dir(d); times.append((time.perf_counter() - t0) * 1e3)
    os.unlink(a); os.unlink(b)
print(f'{size}: median {statistics.median(times):.3f} ms; {[round(x, 2) for x in times[:20]]}')
