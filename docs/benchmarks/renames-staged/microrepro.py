#!/usr/bin/env python3
# microrepro.py MOUNT [noseq]: the micro suite's phases by hand on a mounted
# betreefs, in its order (a 2 GiB sequential write and 20,000 random 4 KiB
# writes into it unless "noseq", tokubench's 100,000 files with ./toku, then
# rename + fsync of a file of each size ten times and first links of five
# fresh files of each size), printing every rename's and link's time in ms.
import os, sys, time, random, subprocess, statistics
root = sys.argv[1]; skip_seq = len(sys.argv) > 2 and sys.argv[2] == 'noseq'
def fsync_dir(p):
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY); os.fsync(fd); os.close(fd)
def write_file(path, size):
    chunk = os.urandom(min(size, 1 << 20)); left = size
    with open(path, 'wb') as f:
        while left:
            n = min(left, len(chunk)); f.write(chunk[:n]); left -= n
        f.flush(); os.fsync(f.fileno())
def sync():
    fd = os.open(root, os.O_RDONLY); os.syncfs(fd) if hasattr(os, 'syncfs') else subprocess.run(['sync', '-f', root]); os.close(fd)
seq = os.path.join(root, 'seq')
if not skip_seq:
    write_file(seq, 2 << 30)
    fd = os.open(seq, os.O_RDWR); rnd = random.Random(11); buf = os.urandom(4096)
    for i in range(20000): os.pwrite(fd, buf, rnd.randrange(0, (2 << 30) // 4096) * 4096)
    os.fsync(fd); os.close(fd); os.unlink(seq); subprocess.run(['sync', '-f', root])
os.makedirs(os.path.join(root, 'toku'), exist_ok=True); subprocess.run(['./toku', os.path.join(root, 'toku'), '100000', '2'], stdout=subprocess.DEVNULL)
subprocess.run(['sync', '-f', root])
sizes = [4096 * 4**i for i in range(8)]
ren = os.path.join(root, 'rename'); os.mkdir(ren); subprocess.run(['sync', '-f', root])
for size in sizes:
    a, b = os.path.join(ren, f'r{size}a'), os.path.join(ren, f'r{size}b'); write_file(a, size); fsync_dir(ren)
    ts = []
    for i in range(10):
        f, t = (a, b) if i % 2 == 0 else (b, a)
        t0 = time.perf_counter(); os.rename(f, t); fsync_dir(ren); ts.append((time.perf_counter() - t0) * 1e3)
    os.unlink(a if os.path.exists(a) else b)
    print(f'rename {size}: {statistics.median(ts):.3f} ms {[round(x,2) for x in ts]}', flush=True)
lnk = os.path.join(root, 'link'); os.mkdir(lnk); subprocess.run(['sync', '-f', root])
for size in sizes:
    tl, tf = [], []
    for i in range(5):
        a = os.path.join(lnk, f'link-{size}-{i}'); b = a + '-second'; write_file(a, size); fsync_dir(lnk)
        t0 = time.perf_counter(); os.link(a, b); t1 = time.perf_counter(); fsync_dir(lnk); t2 = time.perf_counter()
        tl.append((t1 - t0) * 1e3); tf.append((t2 - t1) * 1e3); os.unlink(a); os.unlink(b)
    print(f'link {size}: total median {statistics.median([x+y for x,y in zip(tl,tf)]):.3f} link {[round(x,2) for x in tl]} fsync {[round(x,2) for x in tf]}', flush=True)
