#!/bin/bash
# stall-ab.sh for three builds alternated: stall-ab3.sh A B C (ROUNDS rounds, default 2).
here=$(dirname "$0")
for r in $(seq "${ROUNDS:-2}"); do
  for B in "$1" "$2" "$3"; do
    echo "== $B round $r"
    B=$B SECS=30 bash "$here/../settle-steps/stall.sh" 2>&1 |
      grep -E "fsync loop|apply_micros_max|checkpoint_image_micros_max|settle_step_micros_max|evict_micros_max|checkpoint_micros_max|checkpoint_images_locked|root_buffers_copied|fuse.*max|peak_res"
  done
done
