#!/bin/bash
# stall.sh for several builds alternated, ROUNDS rounds (default 2), 30 s each:
# stall-ab.sh BINARY... (the oldest first). Prints the fsync loop's figures, the
# engine's longest holds and copy counters, and the longest FUSE request per run.
here=$(dirname "$0")
for r in $(seq "${ROUNDS:-2}"); do
  for B in "$@"; do
    echo "== stall $B round $r"
    B=$B SECS=30 bash "$here/stall.sh" 2>&1 |
      grep -E "fsync loop|apply_micros_max|checkpoint_image_micros_max|settle_step_micros_max|evict_micros_max|checkpoint_micros_max|checkpoint_images_locked|root_buffers_copied|fuse.*max|peak_res"
  done
done
