//! The generational block allocator of BetrFS 0.2 §3, one generation
//! deeper.
//!
//! Three bitmaps over the node region: `current` (what the in-memory tree
//! and block table reference now), `checkpointed` (what the newest durable
//! checkpoint references) and `previous` (the checkpoint before it). A block
//! is free only when free in all three. BetrFS keeps two generations so that
//! nothing the last checkpoint needs is overwritten before the next one is
//! durable; the third keeps the checkpoint before it intact too, so that if
//! the newest superblock copy is damaged after it was written, recovery
//! from the older copy still finds every node it names (docs/design.md,
//! "Durability"). [`BlockAllocator::commit_checkpoint`] shifts the
//! generations and releases what none of them holds.
//!
//! A checkpoint written while writes go on (docs/design.md, "Checkpoints
//! that do not stop the world") adds a fourth map for the time it is in
//! flight: `pending`, a copy of `current` taken when the checkpoint's block
//! table was encoded ([`BlockAllocator::begin_checkpoint`]). Blocks freed
//! meanwhile may be ones that checkpoint names; they stay held until it is
//! durable and then as its generation, exactly as if they had been freed
//! after it ([`BlockAllocator::commit_pending_checkpoint`]).

use crate::Extent;

pub struct BlockAllocator {
    blocks: u64,
    current: Vec<u64>,
    checkpointed: Vec<u64>,
    previous: Vec<u64>,
    /// What a checkpoint being written references (see the module text).
    pending: Option<Vec<u64>>,
    /// Blocks set in `current | checkpointed | previous | pending`.
    used_blocks: u64,
    /// Next-fit cursor: allocation continues after the last extent, which
    /// keeps a checkpoint's node writes sequential on the device.
    cursor: u64,
}

/// Word `w` of a bitmap; past the end every block counts as used, so a
/// block outside the region is never handed out.
fn word(map: &[u64], w: usize) -> u64 {
    map.get(w).copied().unwrap_or(u64::MAX)
}

fn bit(map: &[u64], i: u64) -> bool {
    word(map, (i / 64) as usize) & (1 << (i % 64)) != 0
}

fn set(map: &mut [u64], i: u64, on: bool) {
    debug_assert!((i / 64) < map.len() as u64, "block {i} outside the bitmap");
    if let Some(word) = map.get_mut((i / 64) as usize) {
        if on {
            *word |= 1 << (i % 64);
        } else {
            *word &= !(1 << (i % 64));
        }
    }
}

impl BlockAllocator {
    /// An allocator over `blocks` blocks with nothing in use.
    pub fn new(blocks: u64) -> BlockAllocator {
        let words = blocks.div_ceil(64) as usize;
        BlockAllocator {
            blocks,
            current: vec![0; words],
            checkpointed: vec![0; words],
            previous: vec![0; words],
            pending: None,
            used_blocks: 0,
            cursor: 0,
        }
    }

    /// Blocks that may not be allocated (in use now or by one of the last
    /// two checkpoints).
    pub fn used_blocks(&self) -> u64 {
        self.used_blocks
    }

    /// Blocks referenced now.
    pub fn live_blocks(&self) -> u64 {
        self.current.iter().map(|w| w.count_ones() as u64).sum()
    }

    fn in_use(&self, i: u64) -> bool {
        self.held_word((i / 64) as usize) & (1 << (i % 64)) != 0
    }

    fn held_word(&self, w: usize) -> u64 {
        let pending = self.pending.as_ref().map_or(0, |p| word(p, w));
        word(&self.current, w) | word(&self.checkpointed, w) | word(&self.previous, w) | pending
    }

    /// Records an extent as in use now and by the newest checkpoint (used
    /// when loading a checkpoint). Returns false if it overlaps one already
    /// marked or lies outside the region: the block table is then corrupt.
    pub fn mark_loaded(&mut self, extent: Extent) -> bool {
        let end = extent.block.saturating_add(extent.blocks());
        if end > self.blocks || (extent.block..end).any(|b| bit(&self.current, b)) {
            return false;
        }
        for b in extent.block..end {
            set(&mut self.current, b, true);
            set(&mut self.checkpointed, b, true);
        }
        self.used_blocks += extent.blocks();
        true
    }

    /// Finds `len` bytes of contiguous free blocks, next-fit from the cursor.
    pub fn allocate(&mut self, len: u32) -> Option<Extent> {
        let want = (len as u64).div_ceil(crate::BLOCK_SIZE as u64).max(1);
        if want > self.blocks {
            return None;
        }
        let start = self
            .find_run(self.cursor, self.blocks, want)
            .or_else(|| self.find_run(0, self.cursor.min(self.blocks), want))?;
        for b in start..start + want {
            set(&mut self.current, b, true);
        }
        self.used_blocks += want;
        self.cursor = start + want;
        Some(Extent { block: start, len })
    }

    /// First run of `want` free blocks starting in [from, to).
    fn find_run(&self, from: u64, to: u64, want: u64) -> Option<u64> {
        let mut b = from;
        while b < to && b + want <= self.blocks {
            // Skip whole words that are completely used in either map.
            if b.is_multiple_of(64) {
                let w = (b / 64) as usize;
                if self.held_word(w) == u64::MAX {
                    b += 64;
                    continue;
                }
            }
            match (b..b + want).find(|&i| self.in_use(i)) {
                None => return Some(b),
                Some(used) => b = used + 1,
            }
        }
        None
    }

    /// Free blocks that lie in free runs of at least `min_run` blocks.
    ///
    /// A word of the maps at a time: the engine counts these under its
    /// tree lock at every checkpoint and as allocations use up its count
    /// (a block at a time, each block read all four maps again).
    pub fn free_blocks_in_runs(&self, min_run: u64) -> u64 {
        let (mut total, mut run) = (0, 0);
        let mut close = |run: &mut u64| {
            if *run >= min_run {
                total += *run;
            }
            *run = 0;
        };
        for w in 0..self.blocks.div_ceil(64) {
            let in_region = (self.blocks - w * 64).min(64);
            // Blocks past the region's end count as used.
            let past_end = u64::MAX.checked_shl(in_region as u32).unwrap_or(0);
            match self.held_word(w as usize) | past_end {
                0 => run += 64,
                u64::MAX => close(&mut run),
                held => {
                    for bit in 0..64 {
                        if held >> bit & 1 == 1 {
                            close(&mut run);
                        } else {
                            run += 1;
                        }
                    }
                }
            }
        }
        close(&mut run);
        total
    }

    /// Releases an extent from the current generation. Its blocks become
    /// reusable at once if neither of the last two checkpoints references
    /// them, otherwise once two more checkpoints are durable.
    pub fn free(&mut self, extent: Extent) {
        for b in extent.block..extent.block + extent.blocks() {
            debug_assert!(bit(&self.current, b), "double free of block {b}");
            set(&mut self.current, b, false);
            if !self.in_use(b) {
                self.used_blocks -= 1;
            }
        }
    }

    fn recount_used(&mut self) {
        self.used_blocks = (0..self.current.len())
            .map(|w| self.held_word(w).count_ones() as u64)
            .sum();
    }

    /// A checkpoint naming exactly the blocks in use now is about to be
    /// written while allocation and freeing go on: hold its blocks until
    /// [`Self::commit_pending_checkpoint`] or [`Self::abort_pending_checkpoint`].
    pub fn begin_checkpoint(&mut self) {
        assert!(
            self.pending.is_none(),
            "allocator invariant: one checkpoint in flight at a time"
        );
        self.pending = Some(self.current.clone());
    }

    /// Adds an extent allocated for the checkpoint in flight (a node image
    /// or its block table) to what it holds.
    pub fn hold_for_checkpoint(&mut self, extent: Extent) {
        self.set_pending(extent, true);
    }

    /// The checkpoint in flight does not name this extent after all (its
    /// node is written elsewhere by it): stop holding it for it.
    pub fn release_from_checkpoint(&mut self, extent: Extent) {
        self.set_pending(extent, false);
    }

    fn set_pending(&mut self, extent: Extent, on: bool) {
        assert!(
            self.pending.is_some(),
            "allocator invariant: no checkpoint in flight for {extent:?}"
        );
        for b in extent.block..extent.block + extent.blocks() {
            let was = self.in_use(b);
            if let Some(pending) = &mut self.pending {
                set(pending, b, on);
            }
            match (was, self.in_use(b)) {
                (false, true) => self.used_blocks += 1,
                (true, false) => self.used_blocks -= 1,
                _ => {}
            }
        }
    }

    /// The checkpoint in flight is given up before anything of it was
    /// written: nothing is held for it any more.
    pub fn cancel_pending_checkpoint(&mut self) {
        self.pending = None;
        self.recount_used();
    }

    /// Whether a checkpoint begun by [`Self::begin_checkpoint`] is in flight.
    pub fn checkpoint_in_flight(&self) -> bool {
        self.pending.is_some()
    }

    /// The checkpoint begun by [`Self::begin_checkpoint`] is durable: it
    /// becomes the newest generation (what was freed since it began stays
    /// held by it).
    pub fn commit_pending_checkpoint(&mut self) {
        let Some(pending) = self.pending.take() else {
            panic!("allocator invariant: no checkpoint in flight to commit");
        };
        self.previous = std::mem::replace(&mut self.checkpointed, pending);
        self.recount_used();
    }

    /// The checkpoint begun by [`Self::begin_checkpoint`] failed: it may
    /// still have reached the device in part (a superblock naming it
    /// among them), so its blocks stay held as if it were the newest
    /// generation, beside the real one, until two more checkpoints commit.
    pub fn abort_pending_checkpoint(&mut self) {
        if let Some(pending) = self.pending.take() {
            for (held, p) in self.checkpointed.iter_mut().zip(pending) {
                *held |= p;
            }
            self.recount_used();
        }
    }

    /// The checkpoint whose extents are exactly `current` is durable: the
    /// newest checkpoint becomes the previous one, and the blocks only the
    /// old previous one used are free from now on.
    pub fn commit_checkpoint(&mut self) {
        self.begin_checkpoint();
        self.commit_pending_checkpoint();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn checkpointed_blocks_survive_two_commits() {
        let mut a = BlockAllocator::new(12);
        let x = a.allocate(4096 * 4).unwrap();
        a.commit_checkpoint();
        a.free(x);
        // The freed extent is still referenced by the checkpoint.
        let y = a.allocate(4096 * 4).unwrap();
        assert_eq!(y.block, 4);
        a.commit_checkpoint();
        // ... and by the previous one after the next checkpoint.
        a.free(y);
        let z = a.allocate(4096 * 4).unwrap();
        assert_eq!(z.block, 8);
        assert!(a.allocate(4096).is_none());
        a.commit_checkpoint();
        // x is held by no generation now; y still by the previous one.
        assert_eq!(a.allocate(4096 * 4).unwrap().block, 0);
        assert!(a.allocate(4096).is_none());
    }

    #[test]
    fn free_runs_are_counted_by_length() {
        let mut a = BlockAllocator::new(200);
        let x = a.allocate(4096 * 10).unwrap(); // 0..10
        let _y = a.allocate(4096).unwrap(); // 10
        a.free(x);
        // Free: 0..10 (10 blocks) and 11..200 (189 blocks).
        assert_eq!(a.free_blocks_in_runs(1), 199);
        assert_eq!(a.free_blocks_in_runs(11), 189);
        assert_eq!(a.free_blocks_in_runs(190), 0);
    }

    proptest! {
        #[test]
        fn never_hands_out_a_block_in_use(ops in proptest::collection::vec((0u8..8, 1u32..20_000), 1..200)) {
            // Not a whole number of bitmap words: the last one is partly
            // past the region.
            const BLOCKS: u64 = 150;
            let mut a = BlockAllocator::new(BLOCKS);
            let mut live: Vec<Extent> = Vec::new();
            let mut ckpt: Vec<Extent> = Vec::new();
            let mut prev: Vec<Extent> = Vec::new();
            // A checkpoint in flight: what `live` was when it began.
            let mut pending: Option<Vec<Extent>> = None;
            for (op, len) in ops {
                match op {
                    0 => if let Some(e) = a.allocate(len) {
                        for other in live.iter().chain(ckpt.iter()).chain(prev.iter()).chain(pending.iter().flatten()) {
                            let disjoint = e.block + e.blocks() <= other.block || other.block + other.blocks() <= e.block;
                            prop_assert!(disjoint, "{e:?} overlaps {other:?}");
                        }
                        live.push(e);
                    },
                    1 if !live.is_empty() => {
                        let e = live.remove(len as usize % live.len());
                        a.free(e);
                    }
                    2 if pending.is_none() => { a.commit_checkpoint(); prev = std::mem::replace(&mut ckpt, live.clone()); }
                    3 if pending.is_none() => { a.begin_checkpoint(); pending = Some(live.clone()); }
                    3 | 4 => if let Some(p) = pending.take() {
                        if len % 4 == 0 {
                            // Failed: held beside the newest generation.
                            a.abort_pending_checkpoint();
                            ckpt.extend(p);
                        } else {
                            a.commit_pending_checkpoint();
                            prev = std::mem::replace(&mut ckpt, p);
                        }
                    },
                    // An extent written for the checkpoint in flight.
                    5 if !live.is_empty() => if let Some(p) = &mut pending {
                        let e = live[len as usize % live.len()];
                        if !p.contains(&e) {
                            a.hold_for_checkpoint(e);
                            p.push(e);
                        }
                    },
                    // One it turned out not to name.
                    6 => if let Some(p) = &mut pending {
                        if !p.is_empty() {
                            let e = p.remove(len as usize % p.len());
                            a.release_from_checkpoint(e);
                        }
                    },
                    7 if pending.is_some() => {
                        a.cancel_pending_checkpoint();
                        pending = None;
                    }
                    _ => {}
                }
                let mut union: Vec<u64> = live.iter().chain(ckpt.iter()).chain(prev.iter()).chain(pending.iter().flatten())
                    .flat_map(|e| e.block..e.block + e.blocks()).collect();
                union.sort_unstable();
                union.dedup();
                prop_assert_eq!(a.used_blocks(), union.len() as u64);
                // Free runs, from the model: the gaps between used blocks.
                let mut runs = Vec::new();
                let mut from = 0;
                for &b in union.iter().chain(std::iter::once(&BLOCKS)) {
                    runs.push(b - from);
                    from = b + 1;
                }
                for min_run in [1, 3, 64, 65, BLOCKS] {
                    let expected: u64 = runs.iter().filter(|&&r| r >= min_run).sum();
                    prop_assert_eq!(a.free_blocks_in_runs(min_run), expected, "runs of {}", min_run);
                }
            }
        }
    }
}
