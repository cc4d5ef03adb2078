#!/bin/bash
# Hand run: untar the kernel source while a loop writes 4 KiB + fsync; then engine stats.
# B=binary (default target/release/betreefs of this checkout), OPTS=mount options,
# SECS=fsync loop seconds, FG=1: daemon in the foreground (stderr in /tmp/stall-daemon.err),
# RENICE=n: renice the daemon's threads, TAR=the tree to untar (default /var/tmp/linux.tar:
# xz -dc /usr/src/linux-source-6.1.tar.xz > /var/tmp/linux.tar, from Debian's linux-source-6.1).
B=${B:-$(cd "$(dirname "$0")/../../.." && pwd)/target/release/betreefs}
IMG=/var/tmp/stall.img; MNT=/tmp/stall-mnt
SECS=${SECS:-40}
rm -f $IMG; mkdir -p $MNT
if [ -n "$FG" ]; then
  $B mount $IMG $MNT ${OPTS:+-o $OPTS} --foreground 2> /tmp/stall-daemon.err & sleep 2
  for i in 1 2 3 4 5; do mountpoint -q $MNT && break; sleep 1; done
else
  $B mount $IMG $MNT ${OPTS:+-o $OPTS} || exit 1
fi
if [ -n "$RENICE" ]; then for p in $(pgrep -f "mount $IMG"); do renice -n $RENICE -p $p >/dev/null; for t in /proc/$p/task/*; do renice -n $RENICE -p ${t##*/} >/dev/null; done; done; fi
TAR=${TAR:-/var/tmp/linux.tar}
mkdir -p $MNT/src
( cd $MNT/src && tar xf $TAR ) & TP=$!
python3 - $MNT/fsync.dat $SECS <<'PY'
import os, sys, time
path, secs = sys.argv[1], float(sys.argv[2])
fd = os.open(path, os.O_CREAT|os.O_WRONLY, 0o644)
buf = b'x'*4096; lat=[]; i=0; end=time.time()+secs
while time.time() < end:
    t=time.perf_counter(); os.pwrite(fd, buf, (i%256)*4096); os.fsync(fd); lat.append(time.perf_counter()-t); i+=1
lat.sort(); n=len(lat)
print(f"fsync loop: n={n} p99={lat[int(n*0.99)]*1e3:.2f}ms p99.9={lat[int(n*0.999)]*1e3:.2f}ms max={lat[-1]*1e3:.1f}ms")
PY
wait $TP
$B stats $MNT > /tmp/stall-stats.json
python3 - <<'PY'
import json
s=json.load(open('/tmp/stall-stats.json'))
def find(d, pre=''):
    for k,v in d.items():
        if isinstance(v, dict): find(v, pre+k+'.')
        elif any(x in k for x in ('micros_max','waited','flush_turns','flushes','peak_res','settle','root_buffers_copied','images_locked')) or (pre.startswith('fuse') and 'max' in k): print(pre+k, v)
find(s)
PY
$B umount $MNT
