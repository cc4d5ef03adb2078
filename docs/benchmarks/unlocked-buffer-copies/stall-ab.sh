#!/bin/bash
# The untar + write/fsync loop (settle-steps/stall.sh, 30 s loop) for two builds
# alternated, ROUNDS rounds (default 2): stall-ab.sh OLD_BINARY NEW_BINARY.
# Prints the loop's latencies, the engine's longest holds, the longest FUSE
# request and the root buffer copies per run.
here=$(dirname "$0")
for r in $(seq "${ROUNDS:-2}"); do
  for B in "$1" "$2"; do
    echo "== $B round $r"
    B=$B SECS=30 bash "$here/../settle-steps/stall.sh" 2>&1 |
      grep -E "fsync loop|apply_micros_max|checkpoint_image_micros_max|settle_step_micros_max|evict_micros_max|checkpoint_micros_max|root_buffers_copied|fuse.*max|peak_res"
  done
done
