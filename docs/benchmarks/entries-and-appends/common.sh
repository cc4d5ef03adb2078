# Shared by the scripts here: B=binary under test, W=work directory.
B=${B:-/work/main/target/release/betreefs}
W=${W:-/var/tmp/entries-and-appends}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$W"
# mount IMG MNT: a foreground daemon (its pid in DP), waited for until mounted
mount_bt() { mkdir -p "$2"; $B mount "$1" "$2" --foreground 2>"$W/daemon.err" & DP=$!
  for i in $(seq 100); do mountpoint -q "$2" && return; sleep 0.1; done; echo "mount failed" >&2; exit 1; }
# the daemon's user and system CPU ticks
daemon_cpu() { awk '{print $14, $15}' /proc/$DP/stat; }
