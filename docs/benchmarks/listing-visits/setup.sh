#!/bin/bash
# setup.sh BIN: a loop device with a betreefs holding the kernel tree, at /var/tmp/s20/img
set -e
BIN=$1
cd /var/tmp/s20
rm -f img; truncate -s 8G img
LOOP=$(losetup -f --show --direct-io=on img); echo $LOOP > loopdev
$BIN mkfs $LOOP --force >/dev/null
mkdir -p mnt
$BIN mount $LOOP mnt
tar xf linux.tar -C mnt; sync
$BIN umount mnt
echo ok $LOOP
