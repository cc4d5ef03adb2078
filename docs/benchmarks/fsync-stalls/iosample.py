# iosample.py DEV,DEV... OUT STOPFILE: every 5 ms until STOPFILE exists, one line
# of the time and, per block device, from /sys/block/DEV/stat: sectors read,
# writes, sectors written, requests in flight, flushes, flush ms, discards,
# discard ms.
import os, sys, time
devs, out, stop = sys.argv[1].split(','), open(sys.argv[2], 'w'), sys.argv[3]
while not os.path.exists(stop):
    row = [f"{time.time():.4f}"]
    for d in devs:
        f = open(f'/sys/block/{d}/stat').read().split()
        row += [f[2], f[4], f[6], f[8], f[15], f[16], f[11], f[14]]
    out.write(' '.join(row) + '\n')
    time.sleep(0.005)
