# 4 KiB write + fsync in a loop beside an untar into MOUNT (the bench's
# "write + fsync during untar" row); prints quantiles and the slow ones.
# usage: python3 probe.py MOUNT [TAR]  (TAR: the kernel source, decompressed)
import os, sys, time, threading, subprocess, json
mnt = sys.argv[1]
side = os.path.join(mnt, "beside"); os.makedirs(side, exist_ok=True)
p = os.path.join(mnt, "fsync-probe")
fd = os.open(p, os.O_CREAT|os.O_TRUNC|os.O_RDWR, 0o644)
os.pwrite(fd, os.urandom(1<<20), 0); os.fsync(fd)
payload = os.urandom(4096)
stop = False; times = []
t0 = time.monotonic(); t0w = time.time()
def w():
    off = 0
    while not stop:
        s = time.monotonic()
        os.pwrite(fd, payload, off); os.fsync(fd)
        e = time.monotonic()
        times.append((s - t0, e - s))
        off = (off + 4096) % (1<<20)
th = threading.Thread(target=w); th.start()
tar = sys.argv[2] if len(sys.argv) > 2 else "/dev/shm/linux-source-6.1.tar"
subprocess.run(["tar", "xf", tar, "-C", side], check=True)
untar = time.monotonic() - t0
stop = True; th.join()
lat = sorted(x[1] for x in times)
q = lambda f: lat[min(len(lat)-1, int(f*len(lat)))]*1000
print(f"untar {untar:.1f}s n={len(lat)} p50={q(.5):.2f} p99={q(.99):.2f} p999={q(.999):.2f} max={lat[-1]*1000:.1f} ms")
slow = [x for x in times if x[1] > 0.010]
print("slow(>10ms):", len(slow))
for s, l in slow[:80]:
    print(f"  at {s:7.2f}s {l*1000:7.1f} ms wall {t0w+s:.3f}")
