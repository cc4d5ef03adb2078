# Sourced by seq.sh and random.sh: the scratch directory ($work, from WORK),
# 2 GiB of random bytes there ($work/rand2g, made once), an 8 GiB image on
# a loop device with direct IO ($dev, as betreefs-bench makes them);
# `unmount`, which waits until the daemon has let the device go, and
# `fresh_mount`; the device and image go when the script exits.
work=${WORK:-/var/tmp/leaf-fill}
mkdir -p "$work/mnt"
[ -f "$work/rand2g" ] || head -c 2147483648 /dev/urandom > "$work/rand2g"
img=$work/ab.img
rm -f "$img"; truncate -s 8G "$img"; chmod 600 "$img"
dev=$(losetup -f --show --direct-io=on "$img")
unmount() { umount "$work/mnt"; while pgrep -f "mount $dev $work/mnt" > /dev/null; do sleep 0.1; done; }
cleanup() { if mountpoint -q "$work/mnt"; then unmount; fi; losetup -d "$dev"; rm -f "$img"; }
trap cleanup EXIT
# A fresh file system made by build $1 on the device, mounted.
fresh_mount() { "$1" mkfs --force "$dev" > /dev/null; "$1" mount "$dev" "$work/mnt"; }
