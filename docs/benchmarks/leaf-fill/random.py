# random.py FILE COUNT SIZE SEED: COUNT writes of SIZE bytes at random
# block-aligned offsets of FILE, then an fsync; prints operations/s.
import os, random, sys, time

path, count, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
payload = os.urandom(size)
fd = os.open(path, os.O_WRONLY)
blocks = os.fstat(fd).st_size // 4096
start = time.time()
for _ in range(count):
    os.pwrite(fd, payload, rng.randrange(blocks) * 4096)
os.fsync(fd)
print("%d" % (count / (time.time() - start)), end=" ")
