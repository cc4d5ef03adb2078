# Fill a mounted file system with files of random sizes (1 B-1 MiB) in 64
# directories until ENOSPC, delete a random half, sync, and again:
# python3 cycle.py MOUNTPOINT SEED CYCLES. Prints what each fill wrote.
import os, random, sys, errno
mnt, seed, cycles = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
live = []
n = 0
for cycle in range(cycles):
    wrote = 0; files = 0
    while True:
        d = os.path.join(mnt, "d%02d" % rng.randrange(64))
        os.makedirs(d, exist_ok=True)
        p = os.path.join(d, "f%07d" % n); n += 1
        size = rng.choice([rng.randrange(1, 4096), rng.randrange(4096, 65536), rng.randrange(65536, 1 << 20)])
        try:
            with open(p, "wb") as f:
                f.write(os.urandom(size))
        except OSError as e:
            if e.errno != errno.ENOSPC: raise
            try: os.unlink(p)
            except OSError as e2: print("unlink after enospc:", e2)
            break
        live.append(p); wrote += size; files += 1
    print(f"seed {seed} cycle {cycle}: wrote {files} files {wrote>>20} MiB, live {len(live)}", flush=True)
    rng.shuffle(live)
    half = len(live) // 2
    for p in live[:half]:
        os.unlink(p)
    live = live[half:]
    os.sync()
