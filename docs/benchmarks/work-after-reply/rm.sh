#!/bin/bash
# rm.sh: B=binary; untar the kernel tree, remount, tar cf it (cold), then time rm -rf + sync
# with the daemon's CPU per thread; PERF=1 records the daemon during rm -rf
B=${B:-/work/main/target/release/betreefs}
IMG=/var/tmp/s14/rm.img; MNT=/tmp/s14-rm; mkdir -p $MNT; rm -f $IMG
start() { $B mount $IMG $MNT --foreground 2>/tmp/s14-rm.err & DP=$!; for i in $(seq 100); do mountpoint -q $MNT && break; sleep 0.1; done; }
start; mkdir $MNT/src; (cd $MNT/src && tar xf /var/tmp/linux.tar); umount $MNT; wait $DP
echo 3 > /proc/sys/vm/drop_caches; start
tar cf - -C $MNT src | cat > /dev/null
mv $MNT/src $MNT/moved; sync -f $MNT
cpu() { python3 - $DP <<'PY'
import sys,os,glob
pid=sys.argv[1]; tck=os.sysconf('SC_CLK_TCK'); u=s=0
for t in glob.glob(f"/proc/{pid}/task/*"):
    f=open(t+"/stat").read().split(')')[1].split(); u+=int(f[11]); s+=int(f[12])
print(u/tck, s/tck)
PY
}
read u0 s0 < <(cpu)
[ -n "$PERF" ] && { perf record ${PERFARGS:--F 999 -g} -p $DP -o /var/tmp/s14/perf-rm.data 2>/dev/null & PP=$!; sleep 0.3; }
t0=$(date +%s.%N); rm -rf $MNT/moved; sync -f $MNT; t1=$(date +%s.%N)
[ -n "$PERF" ] && { kill -INT $PP; wait $PP; }
read u1 s1 < <(cpu)
echo "rm -rf + sync $(echo "$t1 - $t0" | bc) s; daemon user $(echo "$u1 - $u0" | bc) sys $(echo "$s1 - $s0" | bc)"
$B stats $MNT > /tmp/s14-rm-stats.json
umount $MNT; wait $DP; rm -f $IMG
