#!/bin/bash
# Alternated untars of builds on a fresh image each: wall, daemon CPU
# (ticks), the longest request (and its opcode), p99.9, and the engine's
# log waits (writes_waited_for_log, writes_flushed_log, the longest wait),
# the longest settling step and checkpoint IO.
#   untar.sh ROUNDS BIN...   (WORK: a directory holding src.tar, the
#   kernel source: xz -dc /usr/src/linux-source-6.1.tar.xz > src.tar)
WORK=${WORK:-/var/tmp/log-room}
cd "$WORK" || exit 1
mkdir -p mnt
for r in $(seq "$1"); do
for b in "${@:2}"; do
"$b" mkfs --force --size 24G uimg > /dev/null; chmod 600 uimg
"$b" mount uimg mnt
P=$(pgrep -n -f "$(basename "$b") mount uimg")
s=$(date +%s.%N); tar xf src.tar -C mnt; sync; e=$(date +%s.%N)
c=$(cat /proc/"$P"/task/*/stat | awk '{t+=$14+$15} END{print t}')
"$b" stats mnt > last-stats.json
echo "$(basename "$b") wall $(echo "$e - $s" | bc | cut -c1-5) cpu $c $(python3 -c "
import json;s=json.load(open('last-stats.json'));f=s['fuse'];e=s['engine'];l=f['latency']
print('max_ms %.1f %s p999_ms %.2f'%(l['max_nanos']/1e6,l['max_opcode'],l['p999_nanos']/1e6), 'logwaits', e.get('writes_waited_for_log','-'), e['writes_flushed_log'], 'logwait_max_ms', e.get('log_wait_micros_max',0)/1e3, 'settle_max_ms', e['settle_step_micros_max']/1e3, 'ckio_max_ms', e['checkpoint_io_micros_max']/1e3)")"
"$b" umount mnt
done; done
