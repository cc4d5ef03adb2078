#!/bin/bash
# Hand run, as root: seqw.sh BINARY — a fresh file system on the loop
# device named in /var/tmp/sr/w.dev (losetup -f --show --direct-io=on over
# an 8 GiB image), dd of 2 GiB in 1 MiB writes + sync of the file, then the
# engine's and the FUSE front end's counters.
B=$1
mkdir -p /var/tmp/sr/mnt
dev=$(cat /var/tmp/sr/w.dev)
mountpoint -q /var/tmp/sr/mnt && { umount /var/tmp/sr/mnt; while pgrep -f "mount $dev /var/tmp/sr/mnt" >/dev/null; do sleep 0.1; done; }
$B mkfs --force $dev >/dev/null
$B mount $dev /var/tmp/sr/mnt
t0=$(date +%s.%N)
dd if=/dev/zero of=/var/tmp/sr/mnt/f bs=1M count=2048 status=none
t1=$(date +%s.%N)
sync /var/tmp/sr/mnt/f
t2=$(date +%s.%N)
echo "$(basename $B): write $(echo "$t1 - $t0" | bc) s, +sync $(echo "$t2 - $t0" | bc) s, $(echo "2048*1.048576/($t2 - $t0)" | bc) MB/s"
$B stats /var/tmp/sr/mnt | python3 -c "
import json,sys; d=json.load(sys.stdin); e=d['engine']; f=d['fuse']
print('  flushed_log', e['writes_flushed_log'], 'ckpt_io_total', e['checkpoint_io_micros_total']//1000, 'ms; write p50/p99/max ms', f['latency']['p50_nanos']/1e6, f['latency']['p99_nanos']/1e6, f['latency']['max_nanos']/1e6, 'dev_written', e['device_bytes_written']//2**20)"
umount /var/tmp/sr/mnt; while pgrep -f "mount $dev /var/tmp/sr/mnt" >/dev/null; do sleep 0.1; done
