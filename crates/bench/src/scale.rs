//! How big each workload is at each scale.

use serde::Serialize;

use crate::suites::Suite;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Scale {
    /// A smoke run: every phase, tiny sizes, under 2 minutes for two file
    /// systems.
    Quick,
    /// The whole thing for all six file systems in under 45 minutes on a
    /// 2-core machine.
    Default,
    /// The papers' sizes.
    Paper,
}

/// Which tree the source-tree and application suites use.
#[derive(Debug, Clone, Serialize)]
pub enum SourceTree {
    /// A generated tree of this many files (C-like text, nested
    /// directories): no package needed.
    Synthetic { files: usize },
    /// The Debian linux-source-6.1 tarball, whole or only the named
    /// subdirectories (for the application suite).
    Linux { only: Vec<&'static str> },
}

/// The sizes of one scale.
#[derive(Debug, Clone, Serialize)]
pub struct Params {
    pub scale: Scale,
    /// Size of every image (sparse).
    pub image_size: u64,
    /// Sequential write/read file size; the random writes go into it too.
    pub seq_bytes: u64,
    /// Number of random 4 KiB and of random 4-byte writes.
    pub random_writes: usize,
    /// tokubench: files created (200 bytes each, 2 threads).
    pub toku_files: usize,
    /// Rename and unlink: file sizes, and how often each is measured.
    pub sizes: Vec<u64>,
    pub rename_repeats: usize,
    pub unlink_repeats: usize,
    pub source_tree: SourceTree,
    pub app_tree: SourceTree,
    /// IO amplification: file size, bytes written or read by the 4 KiB
    /// operations, and the number of each metadata operation.
    pub ioamp_file: u64,
    pub ioamp_bytes: u64,
    pub ioamp_meta_ops: usize,
}

fn sizes(from: u64, to: u64) -> Vec<u64> {
    std::iter::successors(Some(from), |s| Some(s * 4))
        .take_while(|s| *s <= to)
        .collect()
}

impl Params {
    pub fn of(scale: Scale) -> Params {
        match scale {
            Scale::Quick => Params {
                scale,
                image_size: 2 * GIB,
                seq_bytes: 256 * MIB,
                random_writes: 5_000,
                toku_files: 5_000,
                sizes: sizes(4 * KIB, 4 * MIB),
                rename_repeats: 3,
                unlink_repeats: 3,
                source_tree: SourceTree::Synthetic { files: 1_000 },
                app_tree: SourceTree::Synthetic { files: 500 },
                ioamp_file: 10 * MIB,
                ioamp_bytes: MIB,
                ioamp_meta_ops: 20,
            },
            Scale::Default => Params {
                scale,
                image_size: 24 * GIB,
                seq_bytes: 2 * GIB,
                random_writes: 20_000,
                toku_files: 100_000,
                sizes: sizes(4 * KIB, 64 * MIB),
                rename_repeats: 10,
                unlink_repeats: 5,
                source_tree: SourceTree::Linux { only: Vec::new() },
                app_tree: SourceTree::Linux {
                    only: vec!["fs", "kernel", "include/linux"],
                },
                ioamp_file: 100 * MIB,
                ioamp_bytes: 10 * MIB,
                ioamp_meta_ops: 200,
            },
            Scale::Paper => Params {
                scale,
                image_size: 96 * GIB,
                seq_bytes: 10 * GIB,
                random_writes: 256_000,
                toku_files: 3_000_000,
                rename_repeats: 20,
                unlink_repeats: 10,
                app_tree: SourceTree::Linux { only: Vec::new() },
                ioamp_meta_ops: 1_000,
                ..Params::of(Scale::Default)
            },
        }
    }
}

/// Rough sizes of the trees (extracted; a tarball is about as big).
const LINUX_TREE_BYTES: u64 = 1600 * MIB;
const LINUX_SUBSET_BYTES: u64 = 400 * MIB;
const SYNTHETIC_FILE_BYTES: u64 = 16 * KIB;

impl SourceTree {
    fn bytes(&self) -> u64 {
        match self {
            SourceTree::Linux { only } if only.is_empty() => LINUX_TREE_BYTES,
            SourceTree::Linux { .. } => LINUX_SUBSET_BYTES,
            SourceTree::Synthetic { files } => *files as u64 * SYNTHETIC_FILE_BYTES,
        }
    }
}

impl Params {
    /// What one file system's sparse image can fill to in the largest of
    /// `suites` (one image exists at a time), with room for metadata,
    /// journals and logs: the free space the work directory needs.
    pub fn workdir_bytes_needed(&self, suites: &[Suite]) -> u64 {
        let largest = suites
            .iter()
            .map(|s| match s {
                Suite::Micro => {
                    let unlink: u64 = self.sizes.iter().sum::<u64>() * self.unlink_repeats as u64;
                    self.seq_bytes + unlink + self.toku_files as u64 * 8 * KIB
                }
                Suite::Source => self.source_tree.bytes() * 2,
                // The tree, two rsync copies, an archive, its extraction,
                // git objects and a clone.
                Suite::App => self.app_tree.bytes() * 8,
                // The big file, the small ones, and the directory of ten
                // big files a rename moves.
                Suite::Ioamp => 11 * self.ioamp_file + 3 * self.ioamp_bytes + 64 * MIB,
            })
            .max()
            .unwrap_or(0);
        largest + largest / 4 + GIB
    }

    /// What the tarballs need in /dev/shm.
    pub fn shm_bytes_needed(&self, suites: &[Suite]) -> u64 {
        let mut trees: Vec<&SourceTree> = Vec::new();
        if suites.contains(&Suite::Source) {
            trees.push(&self.source_tree);
        }
        if suites.contains(&Suite::App) {
            trees.push(&self.app_tree);
        }
        // Both Linux trees come from one decompressed tarball.
        let linux = trees.iter().any(|t| matches!(t, SourceTree::Linux { .. }));
        let synthetic: u64 = trees
            .iter()
            .filter(|t| matches!(t, SourceTree::Synthetic { .. }))
            .map(|t| t.bytes() * 2)
            .sum();
        if linux {
            LINUX_TREE_BYTES + synthetic
        } else {
            synthetic
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_grow_by_four_to_the_limit() {
        assert_eq!(sizes(4 * KIB, 64 * KIB), vec![4 * KIB, 16 * KIB, 64 * KIB]);
        assert_eq!(sizes(4 * KIB, 64 * MIB).len(), 8);
    }

    #[test]
    fn space_needed_grows_with_the_scale_and_the_suites() {
        let all = [Suite::Micro, Suite::Source, Suite::App, Suite::Ioamp];
        let quick = Params::of(Scale::Quick);
        let default = Params::of(Scale::Default);
        let paper = Params::of(Scale::Paper);
        assert!(quick.workdir_bytes_needed(&all) < default.workdir_bytes_needed(&all));
        assert!(default.workdir_bytes_needed(&all) < paper.workdir_bytes_needed(&all));
        // The default scale's largest suite is the 2 GiB sequential file.
        assert!(default.workdir_bytes_needed(&all) > 2 * GIB);
        assert!(
            default.workdir_bytes_needed(&[Suite::Ioamp])
                < default.workdir_bytes_needed(&[Suite::Micro])
        );
        assert_eq!(default.shm_bytes_needed(&[Suite::Micro]), 0);
        assert_eq!(default.shm_bytes_needed(&all), LINUX_TREE_BYTES);
        assert!(quick.shm_bytes_needed(&all) > 0);
        for p in [&quick, &default, &paper] {
            assert!(p.workdir_bytes_needed(&all) < p.image_size * 2);
        }
    }

    #[test]
    fn every_scale_fits_its_image() {
        for scale in [Scale::Quick, Scale::Default, Scale::Paper] {
            let p = Params::of(scale);
            // The sequential file, the largest unlink files and slack.
            let unlink_bytes: u64 = p.sizes.iter().sum::<u64>() * p.unlink_repeats as u64;
            assert!(p.seq_bytes + unlink_bytes < p.image_size / 2, "{scale:?}");
            assert!(p.ioamp_bytes <= p.ioamp_file);
            assert!(p.ioamp_file.is_multiple_of(4096) && p.ioamp_bytes.is_multiple_of(4096));
        }
    }
}
