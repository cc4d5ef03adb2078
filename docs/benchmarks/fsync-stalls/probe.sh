#!/bin/bash
# probe.sh BIN: where a 4 KiB write + fsync stalls beside an untar.
# A fresh betreefs on a loop device, the kernel tree untarred and synced, then a
# loop of 4 KiB pwrite + fsync (round-robin in a 1 MiB file) while a second
# untar runs, as betreefs-bench's source suite does; every call over 10 ms is
# printed with its wall-clock end. Meanwhile iosample.py records the loop
# device's and its backing disk's counters every 5 ms (io.txt), and the
# daemon's stderr goes to daemon.err (with a build carrying instr.diff: its
# device writes, syncs and log flushes over 4 ms). Then: python3 stallan.py out.txt
#   WORK: a directory holding src.tar (xz -dc /usr/src/linux-source-6.1.tar.xz > src.tar),
#         an empty directory rmnt, and loop.txt naming a loop device over a 16 GiB image
#   DISK: the disk holding the image (default vda); RENICE=n renices the daemon's threads
HERE=$(cd "$(dirname "$0")" && pwd); B=$1; cd "${WORK:-/var/tmp/fsync-stalls}" || exit 1
LOOP=$(cat loop.txt); DISK=${DISK:-vda}
$B mkfs "$LOOP" --force > /dev/null
$B mount "$LOOP" rmnt --foreground 2> daemon.err & sleep 2
if [ -n "$RENICE" ]; then for p in $(pgrep -f "mount $LOOP"); do for t in /proc/"$p"/task/*; do renice -n "$RENICE" -p "${t##*/}" > /dev/null; done; done; fi
mkdir rmnt/a rmnt/b; tar xf src.tar -C rmnt/a; sync
python3 - rmnt/probe "$PWD/stop" <<'PY' &
import os, sys, time
path, stop = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
os.pwrite(fd, os.urandom(1 << 20), 0); os.fsync(fd)
buf = os.urandom(4096); lat = []; i = 0
while not os.path.exists(stop):
    t = time.perf_counter(); os.pwrite(fd, buf, (i % 256) * 4096); os.fsync(fd)
    d = time.perf_counter() - t; lat.append(d); i += 1
    if d > 0.010: print(f"  slow fsync at {time.time():.3f}: {d * 1e3:.1f} ms", flush=True)
lat.sort(); n = len(lat)
print(f"fsync loop: n={n} p99={lat[int(n * 0.99)] * 1e3:.2f}ms p99.9={lat[int(n * 0.999)] * 1e3:.2f}ms max={lat[-1] * 1e3:.1f}ms")
PY
PP=$!; rm -f stop
python3 "$HERE/iosample.py" "$(basename "$LOOP"),$DISK" io.txt stop & SP=$!; sleep 0.5
tar xf src.tar -C rmnt/b; touch stop; wait $PP $SP; rm -f stop
$B stats rmnt | python3 -c "import json,sys; print(json.load(sys.stdin)['fuse']['latency'])"
$B umount rmnt
