#!/bin/bash
# mvstats.sh BIN: the suite's state before its mv, then mv (longer name) + sync with the engine's read/write counters
cd /var/tmp/s20; B=$1
rm -f img; truncate -s 8G img; LOOP=$(losetup -f --show --direct-io=on img)
$B mkfs $LOOP --force >/dev/null; $B mount $LOOP mnt
tar xf linux.tar -C mnt; sync; $B umount mnt
T=linux-source-6.1
for r in 1 2 3 4; do
  $B mount $LOOP mnt; echo 3 > /proc/sys/vm/drop_caches
  tar cf - -C mnt $T | cat > /dev/null
  $B stats mnt > a.json
  s=$(date +%s.%N); mv mnt/$T mnt/moved; m=$(date +%s.%N); sync; e=$(date +%s.%N); echo "mv alone $(echo "($m - $s)*1000" | bc) ms"
  $B stats mnt > b.json
  python3 -c "
import json
a=json.load(open('a.json'))['engine']; b=json.load(open('b.json'))['engine']
keys=[k for k in b if isinstance(b[k],(int,float)) and b[k]!=a.get(k) and ('read' in k or 'written' in k or 'node' in k)]
print('mv %.1f ms' % (($e-$s)*1000), ' '.join('%s=%s' % (k, b[k]-a.get(k,0)) for k in keys))
fa=json.load(open('a.json'))['fuse']; fb=json.load(open('b.json'))['fuse']
print(' '.join('%s %dx %.2f ms' % (op, fb[op]['count']-fa.get(op,{}).get('count',0), (fb[op]['nanos']-fa.get(op,{}).get('nanos',0))/1e6) for op in fb if isinstance(fb[op],dict) and 'count' in fb[op] and fb[op]['count']!=fa.get(op,{}).get('count',0)))"
  mv mnt/moved mnt/$T; $B umount mnt
done
losetup -d $LOOP; rm -f img
