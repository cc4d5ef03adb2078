//! `mkfs`, `fsck` and `stats`: the commands around a mounted file system.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use betreefs_engine::{Options, Store};
use betreefs_fs::{Caller, FileSystem};

/// The size of an image created without `--size`.
pub const DEFAULT_IMAGE_SIZE: u64 = 8 << 30;

/// Engine options for an image of `size` bytes: nodes of 1/256 of the
/// device, between 256 KiB and 4 MiB. Nodes are written copy-on-write as
/// contiguous extents, so a small device needs small nodes to keep
/// checkpointing (and deleting) possible when it is nearly full. The node
/// size is a split threshold, not part of the format: an image opened with
/// another one stays readable.
pub fn engine_options(size: u64) -> Options {
    let node = (size / 256)
        .clamp(256 << 10, 4 << 20)
        .next_power_of_two()
        .min(4 << 20);
    Options {
        node_size: node as usize,
        basement_size: (node as usize / 8).min(128 << 10),
        ..Options::default()
    }
}

/// Engine options for an existing image or device.
pub fn engine_options_for(path: &Path) -> Options {
    let size = std::fs::File::open(path)
        .and_then(|mut f| std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)))
        .unwrap_or(DEFAULT_IMAGE_SIZE);
    engine_options(size)
}

/// Parses sizes like `4G`, `512M`, `100k`, `4GiB` or plain bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| format!("not a size: {s:?}"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("unknown size unit in {s:?} (use K, M, G or T)")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

#[derive(clap::Args)]
pub struct MkfsArgs {
    /// Image file (created sparse) or block device.
    pub path: PathBuf,
    /// Size, e.g. 4G: of a new image file (default 8G), or how much of a
    /// block device to use (default: all of it).
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Overwrite an existing image, or a device that holds a file system.
    #[arg(long)]
    pub force: bool,
}

fn caller() -> Caller {
    // SAFETY: getuid/getgid have no preconditions and cannot fail.
    unsafe { Caller::new(libc::getuid(), libc::getgid()) }
}

/// What `path` already holds, if anything recognisable: a betreefs (its
/// magic in either superblock), or whatever blkid(8) finds (file systems,
/// swap, RAID members, partition tables).
pub fn existing_signature(path: &Path) -> Option<String> {
    let mut head = vec![0u8; 2 * 4096];
    if let Ok(mut f) = std::fs::File::open(path) {
        let n = f.read(&mut head).unwrap_or(0);
        head.truncate(n);
    }
    let magic = betreefs_store::MAGIC;
    if head.starts_with(&magic) || head.get(4096..4104) == Some(&magic[..]) {
        return Some("a betreefs file system".into());
    }
    let out = std::process::Command::new("blkid")
        .args(["-p", "-o", "export"])
        .arg(path)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name).map(str::to_string))
    };
    match (field("TYPE="), field("PTTYPE=")) {
        (Some(kind), _) => Some(format!("a {kind} file system or signature")),
        (None, Some(table)) => Some(format!("a {table} partition table")),
        (None, None) => None,
    }
}

/// The size of a block device, or `None` for anything else.
fn block_device_bytes(path: &Path) -> Result<Option<u64>> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(None);
    };
    if !meta.file_type().is_block_device() {
        return Ok(None);
    }
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let bytes = std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0))
        .with_context(|| format!("sizing {}", path.display()))?;
    Ok(Some(bytes))
}

/// Formats an image: an empty store holding an empty file system. `size`
/// is the size of a new image file (default 8 GiB) or how much of a block
/// device to use (default: all of it). Returns the size formatted.
pub fn mkfs(path: &Path, size: Option<u64>, force: bool) -> Result<u64> {
    let device_bytes = block_device_bytes(path)?;
    let size = match (device_bytes, size) {
        (Some(dev), Some(s)) if s > dev => bail!(
            "{} holds only {} MiB, less than the {} MiB asked for",
            path.display(),
            dev >> 20,
            s >> 20
        ),
        (Some(dev), s) => s.unwrap_or(dev),
        (None, s) => s.unwrap_or(DEFAULT_IMAGE_SIZE),
    };
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.is_dir() {
            bail!("{} is a directory", path.display());
        }
        let occupied = device_bytes.is_some() || meta.len() > 0;
        if occupied && !force {
            match existing_signature(path) {
                Some(what) => bail!(
                    "{} already holds {what}; pass --force to overwrite it",
                    path.display()
                ),
                None if device_bytes.is_none() => bail!(
                    "{} already exists ({} bytes of data); pass --force to overwrite it",
                    path.display(),
                    meta.len()
                ),
                None => {}
            }
        }
        if meta.is_file() && meta.len() > 0 {
            std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    let store = Store::create(path, size, engine_options(size))
        .with_context(|| format!("creating {}", path.display()))?;
    FileSystem::format(&store, caller()).map_err(|e| anyhow::anyhow!("formatting: {e}"))?;
    store.close().context("writing the first checkpoint")?;
    Ok(size)
}

pub fn run_mkfs(args: MkfsArgs) -> Result<()> {
    let size = mkfs(&args.path, args.size, args.force)?;
    println!(
        "betreefs: formatted {} ({} MiB)",
        args.path.display(),
        size >> 20
    );
    Ok(())
}

/// Where a mounted file system's daemon listens for `stats`.
pub fn control_socket(mountpoint: &Path) -> Result<PathBuf> {
    let canonical = mountpoint
        .canonicalize()
        .with_context(|| format!("{}", mountpoint.display()))?;
    // FNV-1a of the path: short and stable; the socket path limit is 108.
    let hash = canonical
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf29ce484222325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
    let dir = runtime_dir();
    Ok(dir.join(format!("{hash:016x}.sock")))
}

pub fn runtime_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        PathBuf::from("/run/betreefs")
    } else {
        std::env::var_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir)
            .join("betreefs")
    }
}

#[derive(clap::Args)]
pub struct StatsArgs {
    /// Where a betreefs is mounted.
    pub mountpoint: PathBuf,
}

pub fn run_stats(args: StatsArgs) -> Result<()> {
    println!("{}", control_request(&args.mountpoint, "stats")?.trim_end());
    Ok(())
}

/// Sends one request line to the daemon of the betreefs mounted on
/// `mountpoint` and returns its answer.
pub fn control_request(mountpoint: &Path, request: &str) -> Result<String> {
    let socket = control_socket(mountpoint)?;
    let mut stream = UnixStream::connect(&socket).with_context(|| {
        format!(
            "{} is not a mounted betreefs (no daemon at {})",
            mountpoint.display(),
            socket.display()
        )
    })?;
    stream.write_all(format!("{request}\n").as_bytes())?;
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut out = String::new();
    stream.read_to_string(&mut out)?;
    Ok(out)
}
