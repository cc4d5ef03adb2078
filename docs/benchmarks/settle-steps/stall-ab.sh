#!/bin/bash
# stall.sh for two builds alternated, two rounds, 30 s each: stall-ab.sh OLD NEW.
# Prints the fsync loop's figures and the engine's longest holds per run.
here=$(dirname "$0")
for r in 1 2; do
  for B in "$1" "$2"; do
    echo "== stall $B round $r"
    B=$B SECS=30 bash "$here/stall.sh" 2>&1 |
      grep -E "fsync loop|apply_micros_max|checkpoint_image_micros_max|settle_step_micros_max|evict_micros_max|checkpoint_micros_max|peak_res"
  done
done
