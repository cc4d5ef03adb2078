//! The circular redo log: a byte stream of checksummed records laid over
//! the log region, flushed with group commit.
//!
//! Positions are 64-bit stream offsets that only grow; stream position `p`
//! lives at `log_offset + p % log_bytes`. A record (format version 2) is
//!
//! ```text
//! off      size field
//!   0         4 payload_len n
//!   4         4 crc32c of bytes [8, 28 + n)
//!   8         4 epoch        (the superblock's log_epoch when it was written)
//!  12         8 seq          (the batch sequence number; consecutive records +1)
//!  20         n payload      (opaque to this layer)
//!  20 + n     8 flush_first  (seq of the first record of the flush that
//!                            wrote this one: every record before it had
//!                            been made durable by an earlier flush)
//! ```
//!
//! The bytes after the last record of a flush are zero up to the block end.
//! Replay starts at the superblock's `log_head` expecting `checkpoint_seq+1`
//! and stops at the first record that is torn (checksum), stale (other epoch
//! or sequence number: the previous lap of the circle) or absent (zeros).
//!
//! Where replay stops is the end of the log only if nothing lies beyond it.
//! A power cut tears at most the last flush, and a torn write keeps a
//! prefix of what it wrote, so an intact record of the same epoch numbered
//! at or past the point where replay stopped cannot be the debris of a
//! crash: the log has a hole (a lost or misdirected write, or damage), and
//! [`replay_log`] reports it instead of taking it for the end. Its
//! `flush_first` tells how sure that is: above the missing number, the
//! missing record had been made durable by an earlier flush; otherwise both
//! were written by one flush, which a disk that reorders sectors within a
//! torn write could also leave behind — still reported, never guessed
//! away, since that flush may have been acknowledged.
//!
//! The writer keeps every record from the previous checkpoint's log head
//! on, not only the newest one's: if the newest superblock copy is lost,
//! the older copy still finds every record it needs (docs/design.md).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::bytes::{le_u32 as u32_le, le_u64 as u64_le};
use crate::log_buffer::LogBuffer;
use crate::{crc32c_of, AlignedBuf, Device, StoreError, StoreResult, BLOCK_SIZE};

/// Bytes of a record before its payload.
pub const LOG_RECORD_HEADER_BYTES: usize = 20;
/// Bytes of a record after its payload.
pub const LOG_RECORD_TRAILER_BYTES: usize = 8;
/// Bytes a record takes besides its payload.
pub const LOG_RECORD_OVERHEAD_BYTES: usize = LOG_RECORD_HEADER_BYTES + LOG_RECORD_TRAILER_BYTES;
const BLOCK: u64 = BLOCK_SIZE as u64;
/// A flush writes the log through a buffer of at most this many bytes
/// (a few blocks in the unit tests, whose regions are 64 KiB: every flush
/// of theirs that spans blocks goes in pieces).
const LOG_WRITE_PIECE_BYTES: u64 = if cfg!(test) { 2 * BLOCK } else { 1 << 20 };

fn floor_block(pos: u64) -> u64 {
    pos / BLOCK * BLOCK
}

/// A record appended since the last flush began: its checksum and
/// `flush_first` are filled in when a flush takes it.
struct Unstamped {
    /// Stream position of the record.
    at: u64,
    seq: u64,
    payload_len: usize,
    /// CRC32C of epoch, seq and payload (the trailer is added at flush).
    partial_crc: u32,
}

struct LogState {
    /// The log head of the newest checkpoint: replay after it starts here.
    head: u64,
    /// The log head of the checkpoint before it: nothing from here on is
    /// overwritten, so a recovery from the older superblock copy finds
    /// every record it needs.
    protected: u64,
    /// Where the next record goes.
    append_pos: u64,
    /// Everything before this position is durable.
    durable_pos: u64,
    /// Stream bytes [buf_start, append_pos) not yet durable, starting at a
    /// block boundary (so the partial tail block is rewritten whole).
    buf_start: u64,
    buf: LogBuffer,
    unstamped: Vec<Unstamped>,
    flushing: bool,
    /// Callers inside [`LogWriter::flush_urgent`].
    urgent_flushes: usize,
    /// When the last of them began.
    last_urgent_flush: Option<std::time::Instant>,
    /// `append_pos` at the last [`LogWriter::release_spares_if_idle`].
    append_pos_at_idle_check: u64,
    failure: Option<String>,
}

impl LogState {
    /// Stream bytes the buffer holds, [buf_start, append_pos): what
    /// [`LogWriter::make_room`]'s bound and [`LogBufferUse::buffered`]
    /// count alike.
    fn buffered(&self) -> u64 {
        self.append_pos - self.buf_start
    }

    fn advance_buf_start(&mut self, to: u64) {
        if to > self.buf_start {
            let n = ((to - self.buf_start) as usize).min(self.buf.len());
            self.buf.drop_front(n);
            self.buf_start += n as u64;
        }
    }

    /// Fills in the checksum and `flush_first` of every record appended
    /// since the last flush began, which the flush about to run writes.
    fn stamp_for_flush(&mut self) {
        let Some(first) = self.unstamped.first().map(|u| u.seq) else {
            return;
        };
        let trailer = first.to_le_bytes();
        for u in std::mem::take(&mut self.unstamped) {
            // A record a checkpoint took before it was flushed may have
            // left the buffer: it lies before the head and is never read.
            let Some(at) = u.at.checked_sub(self.buf_start) else {
                continue;
            };
            let at = at as usize;
            let crc = crc32c::crc32c_append(u.partial_crc, &trailer);
            let trailer_at = at + LOG_RECORD_HEADER_BYTES + u.payload_len;
            debug_assert!(trailer_at + LOG_RECORD_TRAILER_BYTES <= self.buf.len());
            let stamped = self.buf.write_at(at + 4, &crc.to_le_bytes())
                && self.buf.write_at(trailer_at, &trailer);
            debug_assert!(stamped, "an unstamped record lies in the buffer");
        }
    }
}

/// What the log's buffer holds ([`LogWriter::buffer_use`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogBufferUse {
    /// Bytes appended and not yet durable.
    pub unflushed: u64,
    /// Bytes the buffer holds from its first block on: the unflushed ones
    /// less the pieces a flush in flight has written
    /// ([`LogWriter::make_room`]'s bound is on these).
    pub buffered: u64,
    /// Memory the buffer holds: its unflushed records, those a flush in
    /// flight has yet to write, the durable part of the tail block, rounded up
    /// to the buffer's chunks. What a memory budget counts.
    pub held: u64,
}

/// How [`LogWriter::make_room`] found room in the log's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Room {
    /// There was room: a flush under way had written enough already.
    Ample,
    /// It waited for a flush under way to write pieces.
    Waited,
    /// No flush was under way: it flushed the log itself.
    Flushed,
}

/// Appends records to the log region and makes them durable on demand.
/// Appends only copy into memory; [`LogWriter::flush`] writes and syncs, and
/// concurrent flushes share one device write (group commit).
pub struct LogWriter {
    device: Arc<dyn Device>,
    region_offset: u64,
    region_bytes: u64,
    epoch: u32,
    state: Mutex<LogState>,
    flushed: Condvar,
    bytes_written: AtomicU64,
    flush_count: AtomicU64,
}

impl LogWriter {
    /// A writer whose first record goes at stream position `start`, which is
    /// also the head (recovery has just made everything before it part of a
    /// checkpoint).
    pub fn new(
        device: Arc<dyn Device>,
        region_offset: u64,
        region_bytes: u64,
        epoch: u32,
        start: u64,
    ) -> StoreResult<LogWriter> {
        let buf_start = floor_block(start);
        let mut buf = LogBuffer::default();
        if start > buf_start {
            // Keep the bytes before `start` in its block as they are on disk.
            let mut block = AlignedBuf::zeroed(BLOCK_SIZE);
            device
                .read_at(&mut block, region_offset + buf_start % region_bytes)
                .map_err(|e| StoreError::io("reading log tail", e))?;
            // Less than a block lies before `start` in its block.
            buf.extend_from_slice(
                block
                    .get(..(start - buf_start) as usize)
                    .unwrap_or_default(),
            );
        }
        Ok(LogWriter {
            device,
            region_offset,
            region_bytes,
            epoch,
            state: Mutex::new(LogState {
                head: start,
                protected: start,
                append_pos: start,
                durable_pos: start,
                buf_start,
                buf,
                unstamped: Vec::new(),
                flushing: false,
                urgent_flushes: 0,
                last_urgent_flush: None,
                append_pos_at_idle_check: start,
                failure: None,
            }),
            flushed: Condvar::new(),
            bytes_written: AtomicU64::new(0),
            flush_count: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    pub fn capacity(&self) -> u64 {
        self.region_bytes
    }

    /// Largest payload one record may carry.
    pub fn max_payload(&self) -> u64 {
        max_payload(self.region_bytes)
    }

    /// Bytes appended since the newest checkpoint's head (what the next
    /// checkpoint makes reusable).
    pub fn used(&self) -> u64 {
        let s = self.lock();
        s.append_pos - s.head
    }

    pub fn append_pos(&self) -> u64 {
        self.lock().append_pos
    }

    /// Whether records were appended that are not durable yet.
    pub fn has_unflushed(&self) -> bool {
        self.unflushed_bytes() > 0
    }

    /// Bytes appended but not yet durable.
    pub fn unflushed_bytes(&self) -> u64 {
        self.buffer_use().unflushed
    }

    /// What the log's buffer holds now, read under one hold of its lock
    /// (a writer asks after every batch).
    pub fn buffer_use(&self) -> LogBufferUse {
        let s = self.lock();
        LogBufferUse {
            unflushed: s.append_pos.saturating_sub(s.durable_pos),
            buffered: s.buffered(),
            held: s.buf.held_bytes() as u64,
        }
    }

    /// Keeps up to `bytes` of the buffer's chunks, once flushed, for the
    /// next appends instead of freeing them (the bytes one flush writes
    /// in a stream of appends is enough); they count in
    /// [`LogBufferUse::held`].
    pub fn set_spare_limit(&self, bytes: usize) {
        self.lock().buf.set_spare_limit(bytes);
    }

    /// Frees the buffer's spare chunks if nothing was appended since the
    /// previous call (a caller's timer: an idle log holds no spares).
    pub fn release_spares_if_idle(&self) {
        let mut s = self.lock();
        if s.append_pos == s.append_pos_at_idle_check {
            s.buf.release_spares();
        }
        s.append_pos_at_idle_check = s.append_pos;
    }

    pub fn bytes_written(&self) -> u64 {
        self.bytes_written.load(Ordering::Relaxed)
    }

    pub fn flush_count(&self) -> u64 {
        self.flush_count.load(Ordering::Relaxed)
    }

    /// Appends one record whose payload is `parts` one after the other
    /// (a caller need not join them in a copy first); returns its end
    /// position. Fails with `LogFull` when the record would overwrite the
    /// protected part of the log.
    pub fn append(&self, seq: u64, parts: &[&[u8]]) -> StoreResult<u64> {
        let payload_len: usize = parts.iter().map(|p| p.len()).sum();
        if payload_len as u64 > self.max_payload() {
            return Err(StoreError::RecordTooLarge {
                bytes: payload_len as u64,
                limit: self.max_payload(),
            });
        }
        let epoch = self.epoch.to_le_bytes();
        let seq_bytes = seq.to_le_bytes();
        let partial_crc = parts
            .iter()
            .fold(crc32c_of(&[&epoch, &seq_bytes]), |crc, part| {
                crc32c::crc32c_append(crc, part)
            });
        let mut s = self.lock();
        if let Some(failure) = &s.failure {
            return Err(StoreError::Failed(failure.clone()));
        }
        let record_len = (LOG_RECORD_OVERHEAD_BYTES + payload_len) as u64;
        let end = s.append_pos + record_len;
        // The block holding the protected head is partly live; never write
        // into it.
        if end.div_ceil(BLOCK) * BLOCK > floor_block(s.protected) + self.region_bytes {
            return Err(StoreError::LogFull {
                used: s.append_pos - s.protected,
                capacity: self.region_bytes,
            });
        }
        let at = s.append_pos;
        s.buf.extend_from_slice(&(payload_len as u32).to_le_bytes());
        // The checksum and the trailer are filled in by the flush.
        s.buf.extend_from_slice(&[0; 4]);
        s.buf.extend_from_slice(&epoch);
        s.buf.extend_from_slice(&seq_bytes);
        for part in parts {
            s.buf.extend_from_slice(part);
        }
        s.buf.extend_from_slice(&[0; LOG_RECORD_TRAILER_BYTES]);
        s.unstamped.push(Unstamped {
            at,
            seq,
            payload_len,
            partial_crc,
        });
        s.append_pos = end;
        debug_assert_eq!(s.buf_start + s.buf.len() as u64, s.append_pos);
        Ok(end)
    }

    /// Makes every record appended before the call durable. Callers that
    /// arrive while another flush runs wait for it and then either find
    /// their records covered or write the next group together.
    pub fn flush(&self) -> StoreResult<()> {
        let mut s = self.lock();
        let target = s.append_pos;
        loop {
            if let Some(failure) = &s.failure {
                return Err(StoreError::Failed(failure.clone()));
            }
            if s.durable_pos >= target {
                return Ok(());
            }
            if !s.flushing {
                break;
            }
            s = self.flushed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.flushing = true;
        // Bytes before the head belong to a checkpoint already: never
        // rewrite them (they could lie a whole lap behind the live tail).
        let head_block = floor_block(s.head);
        s.advance_buf_start(head_block);
        s.stamp_for_flush();
        let start = s.buf_start;
        let end = s.append_pos;
        drop(s);

        let result = self.write_stream(start, end);

        let mut s = self.lock();
        s.flushing = false;
        match &result {
            Ok(()) => {
                s.durable_pos = s.durable_pos.max(end);
                s.advance_buf_start(floor_block(end));
                self.flush_count.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => s.failure = Some(format!("log flush failed: {err}")),
        }
        self.flushed.notify_all();
        result
    }

    /// [`LogWriter::flush`] for a caller that waits on it (an fsync):
    /// background writes that check [`LogWriter::wait_for_urgent_flushes`]
    /// leave the device to it meanwhile.
    pub fn flush_urgent(&self) -> StoreResult<()> {
        {
            let mut s = self.lock();
            s.urgent_flushes += 1;
            s.last_urgent_flush = Some(std::time::Instant::now());
        }
        let result = self.flush();
        self.lock().urgent_flushes -= 1;
        self.flushed.notify_all();
        result
    }

    /// Whether a [`LogWriter::flush_urgent`] began within `window`: syncs
    /// are coming, and background writes should leave gaps for them.
    pub fn urgent_flush_within(&self, window: std::time::Duration) -> bool {
        self.lock()
            .last_urgent_flush
            .is_some_and(|t| t.elapsed() < window)
    }

    /// Returns once no [`LogWriter::flush_urgent`] is under way: lets
    /// background writes (a checkpoint's nodes) leave the device to a
    /// waiting fsync. Flushes nobody waits for (the background thread's,
    /// a writer's past its buffer bound) do not hold them up: they would
    /// slow a checkpoint during a burst of writes for no one's sake.
    pub fn wait_for_urgent_flushes(&self) {
        let mut s = self.lock();
        while s.urgent_flushes > 0 && s.failure.is_none() {
            s = self.flushed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Back-pressure for a writer whose records fill the buffer past
    /// `bound` bytes: returns once it holds no more. A flush under way
    /// drops each piece from the buffer once written, so the writer waits
    /// for the first pieces, not for the whole flush and its sync (with
    /// 32 MiB buffered behind a checkpoint's node writes, that took 50-70
    /// ms of an untar's write); with none under way it flushes itself.
    /// Durability is the flushes' business: the room made says nothing
    /// about it.
    pub fn make_room(&self, bound: u64) -> StoreResult<Room> {
        let mut s = self.lock();
        let mut room = Room::Ample;
        loop {
            if let Some(failure) = &s.failure {
                return Err(StoreError::Failed(failure.clone()));
            }
            if s.buffered() <= bound {
                return Ok(room);
            }
            if !s.flushing {
                break;
            }
            room = Room::Waited;
            s = self.flushed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        drop(s);
        self.flush().map(|()| Room::Flushed)
    }

    /// Writes the buffered stream bytes `[start, end)` (`start` at a block
    /// boundary; the last block padded with zeros), wrapping at the end of
    /// the region. A wrapped write is synced in order (end of the region
    /// first) so a crash never keeps the later half without the first.
    ///
    /// The bytes go through one aligned piece of at most
    /// [`LOG_WRITE_PIECE_BYTES`], copied from the buffer under the lock
    /// piece by piece: a copy of the whole buffer would double the memory
    /// a huge record takes (one batch of a tree clone is tens of MB). The
    /// flush owns `[start, end)` meanwhile: appends only add after `end`,
    /// the head's move leaves the buffer alone while a flush runs, and the
    /// flush itself drops each piece once written, up to the block that
    /// holds `end`.
    fn write_stream(&self, start: u64, end: u64) -> StoreResult<()> {
        let padded_end = end.div_ceil(BLOCK) * BLOCK;
        assert!(
            padded_end - start <= self.region_bytes,
            "log write of {} bytes exceeds the {} byte region",
            padded_end - start,
            self.region_bytes
        );
        let io = |e| StoreError::io("writing log", e);
        let mut piece =
            AlignedBuf::for_overwrite((padded_end - start).min(LOG_WRITE_PIECE_BYTES) as usize);
        let mut pos = start;
        while pos < padded_end {
            let physical = pos % self.region_bytes;
            let len = (padded_end - pos)
                .min(LOG_WRITE_PIECE_BYTES)
                .min(self.region_bytes - physical) as usize;
            let filled = ((end.max(pos) - pos) as usize).min(len);
            // `len` is at most the piece's size and `filled` at most `len`.
            let Some((data, padding)) = piece
                .get_mut(..len)
                .and_then(|chunk| chunk.split_at_mut_checked(filled))
            else {
                unreachable!("a log piece of {len} bytes, {filled} of them data");
            };
            {
                let mut s = self.lock();
                // What the pieces before wrote leaves the buffer now: its
                // memory is what writers are held back for
                // ([`LogWriter::make_room`]). Nothing writes those bytes
                // again: a failed write or sync fails the log for good,
                // and the next flush starts at the block holding `end`.
                s.advance_buf_start(floor_block(pos));
                let copied = pos
                    .checked_sub(s.buf_start)
                    .is_some_and(|at| s.buf.copy_to(at as usize, data));
                if !copied {
                    return Err(StoreError::Failed(format!(
                        "log flush lost its bytes: [{pos}, +{filled}) is not in the buffer at {}",
                        s.buf_start
                    )));
                }
            }
            padding.fill(0);
            if pos > start {
                // The piece before left the buffer (above).
                self.flushed.notify_all();
            }
            let chunk = piece.get(..len).unwrap_or_default();
            self.device
                .write_at(chunk, self.region_offset + physical)
                .map_err(io)?;
            pos += len as u64;
            if physical + len as u64 == self.region_bytes && pos < padded_end {
                self.device.sync().map_err(io)?;
            }
        }
        self.device.sync().map_err(io)?;
        self.bytes_written
            .fetch_add(padded_end - start, Ordering::Relaxed);
        Ok(())
    }

    /// Moves the head to `pos` once a checkpoint containing everything
    /// before it is durable. The space before the *previous* head becomes
    /// reusable: until the next checkpoint, a recovery from the previous
    /// superblock copy still needs what lies after it.
    pub fn set_head(&self, pos: u64) {
        let mut s = self.lock();
        debug_assert!(pos >= s.head && pos <= s.append_pos);
        s.protected = s.head;
        s.head = pos;
        // Records before the head are in the checkpoint: no need to write them.
        s.durable_pos = s.durable_pos.max(pos);
        // A flush in flight still copies its bytes from the buffer; the
        // next flush drops what lies before the head.
        if !s.flushing {
            s.advance_buf_start(floor_block(pos));
        }
    }

    /// Marks the log failed: later appends and flushes return an error.
    pub fn fail(&self, why: String) {
        let mut s = self.lock();
        s.failure.get_or_insert(why);
        self.flushed.notify_all();
    }
}

fn max_payload(region_bytes: u64) -> u64 {
    region_bytes / 4 - LOG_RECORD_OVERHEAD_BYTES as u64
}

/// Where replay begins: the superblock's view of the log.
#[derive(Clone, Copy, Debug)]
pub struct ReplayStart {
    /// Stream position of the first record to replay.
    pub head: u64,
    /// Only records of this epoch are replayed.
    pub epoch: u32,
    /// The sequence number the first record must carry.
    pub first_seq: u64,
    /// Look past the end of replay for records that prove a hole (skipped
    /// after a clean close, when nothing follows the checkpoint).
    pub look_beyond: bool,
}

/// A record past the end of replay that shows records are missing: the
/// log has a hole, not an end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogHole {
    /// Where replay stopped, and the sequence number it expected there.
    pub stopped_at: u64,
    pub missing_seq: u64,
    /// The intact record that shows it.
    pub found_at: u64,
    pub found_seq: u64,
    pub found_epoch: u32,
    /// Whether the found record was written by a later flush than the
    /// missing one (which had then certainly been made durable).
    pub later_flush: bool,
}

impl std::fmt::Display for LogHole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if self.later_flush {
            "by a later flush, after the missing one had been made durable"
        } else {
            "by the same flush (damage, or a torn write whose sectors were reordered)"
        };
        write!(
            f,
            "log record {} at log position {} is missing or damaged, but record {} (epoch {}) \
             at position {} is intact, written {how}",
            self.missing_seq, self.stopped_at, self.found_seq, self.found_epoch, self.found_at
        )
    }
}

/// Where replay stopped, and what lies beyond.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayEnd {
    /// Stream position after the last valid record.
    pub end_pos: u64,
    /// Sequence number the next record would carry.
    pub next_seq: u64,
    pub records: u64,
    /// Evidence that records lie past a break in the log.
    pub hole: Option<LogHole>,
}

/// Reads stream bytes through a window of whole blocks.
struct StreamReader<'a> {
    device: &'a dyn Device,
    region_offset: u64,
    region_bytes: u64,
    window_start: u64,
    window: Vec<u8>,
}

const WINDOW_BYTES: u64 = 1 << 20;

/// A record header found at some position.
struct RecordAt {
    epoch: u32,
    seq: u64,
    len: u64,
    flush_first: u64,
    checksum_ok: bool,
}

impl<'a> StreamReader<'a> {
    fn new(device: &'a dyn Device, region_offset: u64, region_bytes: u64) -> Self {
        StreamReader {
            device,
            region_offset,
            region_bytes,
            window_start: 0,
            window: Vec::new(),
        }
    }

    fn read(&mut self, pos: u64, len: usize) -> StoreResult<&[u8]> {
        let end = pos + len as u64;
        let window_end = self.window_start + self.window.len() as u64;
        if pos < self.window_start || end > window_end {
            let start = floor_block(pos);
            let want = (end - start).max(WINDOW_BYTES).min(self.region_bytes);
            let want = want.div_ceil(BLOCK) * BLOCK;
            let mut buf = AlignedBuf::for_overwrite(want as usize);
            let mut done = 0u64;
            while done < want {
                let physical = (start + done) % self.region_bytes;
                let chunk = (self.region_bytes - physical).min(want - done);
                let Some(part) = buf.get_mut(done as usize..(done + chunk) as usize) else {
                    break;
                };
                self.device
                    .read_at(part, self.region_offset + physical)
                    .map_err(|e| StoreError::io("reading log", e))?;
                done += chunk;
            }
            self.window_start = start;
            self.window = buf.to_vec();
        }
        let at = (pos - self.window_start) as usize;
        self.window.get(at..at + len).ok_or(StoreError::CorruptLog {
            position: pos,
            reason: "log window shorter than the read".into(),
        })
    }

    /// Parses the record at `pos`; `None` when there is no plausible record
    /// header there (zeros, or a length that runs past `limit`).
    fn record_at(&mut self, pos: u64, limit: u64) -> StoreResult<Option<RecordAt>> {
        let header_end = pos + LOG_RECORD_HEADER_BYTES as u64;
        if header_end > limit {
            return Ok(None);
        }
        let h = self.read(pos, LOG_RECORD_HEADER_BYTES)?;
        let (len, crc, epoch, seq) = (
            u32_le(h, 0) as u64,
            u32_le(h, 4),
            u32_le(h, 8),
            u64_le(h, 12),
        );
        let record_end = header_end + len + LOG_RECORD_TRAILER_BYTES as u64;
        if (len == 0 && crc == 0) || record_end > limit || len > max_payload(self.region_bytes) {
            return Ok(None);
        }
        let body = self.read(pos + 8, LOG_RECORD_OVERHEAD_BYTES - 8 + len as usize)?;
        let checksum_ok = crc32c_of(&[body]) == crc;
        let flush_first = u64_le(body, body.len() - LOG_RECORD_TRAILER_BYTES);
        Ok(Some(RecordAt {
            epoch,
            seq,
            len,
            flush_first,
            checksum_ok,
        }))
    }
}

/// Replays the records from `start.head` on, calling `apply(seq, payload)`
/// for each valid record in order, and stops at the torn or stale tail.
/// With `look_beyond`, it then reads the rest of the live log window for
/// intact records that show the stop was a hole rather than the end (see
/// the module documentation); the caller decides what a hole means.
pub fn replay_log(
    device: &dyn Device,
    region_offset: u64,
    region_bytes: u64,
    start: &ReplayStart,
    mut apply: impl FnMut(u64, &[u8]) -> StoreResult<()>,
) -> StoreResult<ReplayEnd> {
    let mut reader = StreamReader::new(device, region_offset, region_bytes);
    let limit = floor_block(start.head) + region_bytes;
    let mut pos = start.head;
    let mut seq = start.first_seq;
    let mut records = 0;
    while let Some(rec) = reader.record_at(pos, limit)? {
        if !(rec.checksum_ok && rec.epoch == start.epoch && rec.seq == seq) {
            break;
        }
        let payload = reader
            .read(pos + LOG_RECORD_HEADER_BYTES as u64, rec.len as usize)?
            .to_vec();
        apply(seq, &payload)?;
        pos += LOG_RECORD_OVERHEAD_BYTES as u64 + rec.len;
        seq += 1;
        records += 1;
    }
    let mut end = ReplayEnd {
        end_pos: pos,
        next_seq: seq,
        records,
        hole: None,
    };
    if start.look_beyond {
        look_beyond(&mut reader, start, limit, &mut end)?;
    }
    Ok(end)
}

/// Scans stream positions [end, limit) for intact records of the replayed
/// epoch (newer than the end) or of the next epoch. Candidates are found by
/// their epoch field, so the scan reads the window once and checksums only
/// the few places where a record of interest could start.
fn look_beyond(
    reader: &mut StreamReader<'_>,
    start: &ReplayStart,
    limit: u64,
    end: &mut ReplayEnd,
) -> StoreResult<()> {
    let next_epoch = start.epoch.wrapping_add(1).max(1);
    let needles = [start.epoch.to_le_bytes(), next_epoch.to_le_bytes()];
    let mut chunks = StreamReader::new(reader.device, reader.region_offset, reader.region_bytes);
    // Epoch fields at stream positions [from, limit - 12) are candidates.
    let first_field = end.end_pos + 8;
    let last_field = limit.saturating_sub((LOG_RECORD_OVERHEAD_BYTES - 8) as u64);
    let mut at = first_field;
    while at < last_field {
        let n = (last_field - at).min(WINDOW_BYTES);
        // Four more bytes so a field straddling the chunk end is seen once.
        let chunk = chunks.read(at, (n + 3).min(limit - at) as usize)?.to_vec();
        let mut candidates: Vec<u64> = Vec::new();
        for needle in &needles {
            for i in memchr::memmem::find_iter(&chunk, needle) {
                if (i as u64) < n {
                    candidates.push(at + i as u64 - 8);
                }
            }
        }
        candidates.sort_unstable();
        candidates.dedup();
        for pos in candidates {
            let Some(rec) = reader.record_at(pos, limit)? else {
                continue;
            };
            if !rec.checksum_ok {
                continue;
            }
            let newer_epoch = rec.epoch == next_epoch && rec.epoch != start.epoch;
            if newer_epoch || (rec.epoch == start.epoch && rec.seq >= end.next_seq) {
                end.hole = Some(LogHole {
                    stopped_at: end.end_pos,
                    missing_seq: end.next_seq,
                    found_at: pos,
                    found_seq: rec.seq,
                    found_epoch: rec.epoch,
                    later_flush: newer_epoch || rec.flush_first > end.next_seq,
                });
                return Ok(());
            }
        }
        at += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CrashMode, MemDevice};

    pub(super) const REGION: u64 = 64 * 1024;

    fn start(head: u64, epoch: u32, first_seq: u64) -> ReplayStart {
        ReplayStart {
            head,
            epoch,
            first_seq,
            look_beyond: true,
        }
    }

    pub(super) fn replay(
        dev: &MemDevice,
        head: u64,
        epoch: u32,
        first: u64,
    ) -> (Vec<(u64, Vec<u8>)>, ReplayEnd) {
        let mut out = Vec::new();
        let end = replay_log(dev, BLOCK, REGION, &start(head, epoch, first), |seq, p| {
            out.push((seq, p.to_vec()));
            Ok(())
        })
        .unwrap();
        (out, end)
    }

    pub(super) fn collect(
        dev: &MemDevice,
        head: u64,
        epoch: u32,
        first: u64,
    ) -> Vec<(u64, Vec<u8>)> {
        let (out, end) = replay(dev, head, epoch, first);
        assert_eq!(end.hole, None);
        out
    }

    fn payload(i: u64) -> Vec<u8> {
        vec![i as u8; (i as usize * 37) % 900 + 1]
    }

    fn fresh(epoch: u32) -> (MemDevice, LogWriter) {
        let dev = MemDevice::new(BLOCK + REGION + BLOCK);
        let log = LogWriter::new(Arc::new(dev.clone()), BLOCK, REGION, epoch, 0).unwrap();
        (dev, log)
    }

    /// A flushed log keeps its buffer's chunks as spares for the next
    /// appends, counted in what the buffer holds, and frees them once a
    /// whole idle check passes with nothing appended; the records replay
    /// as appended.
    #[test]
    fn spare_chunks_are_kept_while_appends_come_and_freed_when_idle() {
        let (dev, log) = fresh(3);
        log.set_spare_limit(REGION as usize);
        let record = vec![5u8; 500];
        for seq in 1..=40u64 {
            log.append(seq, &[&record]).unwrap();
        }
        let appended = log.buffer_use().held;
        log.flush().unwrap();
        let flushed = log.buffer_use();
        assert_eq!(flushed.unflushed, 0);
        assert!(
            flushed.held + 8192 >= appended,
            "{flushed:?} against {appended}"
        );
        // Appends since the last check: not idle, the spares stay.
        log.release_spares_if_idle();
        assert_eq!(log.buffer_use(), flushed);
        for seq in 41..=60u64 {
            log.append(seq, &[&record]).unwrap();
        }
        // Half as many records as before: they fit in the spares.
        assert!(
            log.buffer_use().held <= flushed.held,
            "the appends took spares"
        );
        log.flush().unwrap();
        log.release_spares_if_idle();
        assert!(log.buffer_use().held > 0);
        // Nothing appended since: idle, the spares go.
        log.release_spares_if_idle();
        assert!(log.buffer_use().held < 4096, "{:?}", log.buffer_use());
        let seqs: Vec<u64> = collect(&dev, 0, 3, 1).into_iter().map(|(s, _)| s).collect();
        assert_eq!(seqs, (1..=60).collect::<Vec<_>>());
    }

    #[test]
    fn append_flush_replay_and_wrap() {
        let (dev, log) = fresh(7);
        let mut head_seq = 1;
        let mut head = 0;
        for seq in 1..400u64 {
            match log.append(seq, &[&payload(seq)]) {
                Ok(_) => {}
                Err(StoreError::LogFull { .. }) => {
                    // Pretend two checkpoints took everything so far (the
                    // first one still protects the records after its head).
                    log.flush().unwrap();
                    head = log.append_pos();
                    head_seq = seq;
                    log.set_head(head);
                    assert!(matches!(
                        log.append(seq, &[&payload(seq)]),
                        Err(StoreError::LogFull { .. })
                    ));
                    log.set_head(head);
                    log.append(seq, &[&payload(seq)]).unwrap();
                }
                Err(e) => panic!("{e}"),
            }
            if seq % 7 == 0 {
                log.flush().unwrap();
            }
        }
        log.flush().unwrap();
        assert!(head > REGION, "the test must wrap the log");
        let replayed = collect(&dev, head, 7, head_seq);
        assert_eq!(replayed.len() as u64, 400 - head_seq);
        for (seq, p) in replayed {
            assert_eq!(p, payload(seq));
        }
        // A different epoch replays nothing.
        assert!(collect(&dev, head, 8, head_seq).is_empty());
    }

    /// The buffer's memory follows its bytes: a burst holds about what it
    /// appended (a vector grown by doubling held up to twice that), a
    /// flush gives back all but the tail block's durable part, and what
    /// a flush writes stays replayable.
    #[test]
    fn the_buffer_holds_what_it_buffers() {
        let (dev, log) = fresh(1);
        for seq in 1..=100u64 {
            log.append(seq, &[&payload(seq)]).unwrap();
            let LogBufferUse {
                unflushed, held, ..
            } = log.buffer_use();
            assert!(held >= unflushed, "{held} held for {unflushed} bytes");
            assert!(
                held <= unflushed + 2 * BLOCK,
                "{held} held for {unflushed} bytes"
            );
        }
        log.flush().unwrap();
        assert_eq!(log.unflushed_bytes(), 0);
        let held = log.buffer_use().held;
        assert!(held < BLOCK, "{held} held");
        let (replayed, _) = replay(&dev, 0, 1, 1);
        assert_eq!(replayed.len(), 100);
    }

    #[test]
    fn the_previous_head_stays_replayable_until_the_next_checkpoint() {
        let (dev, log) = fresh(3);
        let mut seq = 1;
        let mut append_some = |log: &LogWriter, n: u64| {
            for _ in 0..n {
                log.append(seq, &[&[seq as u8; 500]]).unwrap();
                seq += 1;
            }
            log.flush().unwrap();
        };
        append_some(&log, 20);
        let first_head = log.append_pos();
        log.set_head(first_head);
        append_some(&log, 20);
        log.set_head(log.append_pos());
        // Fill the log as far as the writer lets it: the records after the
        // first head must all survive.
        while log.append(seq, &[&[seq as u8; 500]]).is_ok() {
            seq += 1;
        }
        log.flush().unwrap();
        let replayed = collect(&dev, first_head, 3, 21);
        assert_eq!(replayed.len() as u64, seq - 21);
    }

    #[test]
    fn torn_tail_stops_replay_at_last_valid_record() {
        for sectors in 0..8 {
            let (dev, log) = fresh(1);
            for seq in 1..=5 {
                log.append(seq, &[&[seq as u8; 1500]]).unwrap();
            }
            log.flush().unwrap();
            for seq in 6..=9 {
                log.append(seq, &[&[seq as u8; 1500]]).unwrap();
            }
            dev.fail_after_writes(0);
            assert!(log.flush().is_err());
            assert!(
                log.append(10, &[b"x"]).is_err(),
                "a failed log refuses appends"
            );
            let crashed = MemDevice::from_image(dev.crash_image(CrashMode::TearLast {
                sectors_kept: sectors,
            }));
            let replayed = collect(&crashed, 0, 1, 1);
            // Synced records all survive; torn ones may survive only as a prefix.
            assert!(replayed.len() >= 5, "sectors {sectors}: {}", replayed.len());
            for (i, (seq, p)) in replayed.iter().enumerate() {
                assert_eq!(*seq, i as u64 + 1);
                assert_eq!(p, &vec![*seq as u8; 1500]);
            }
        }
    }

    /// Five records of 100 bytes (128 with the header and trailer), each
    /// flushed on its own.
    fn five_flushes() -> MemDevice {
        let (dev, log) = fresh(1);
        for seq in 1..=5 {
            log.append(seq, &[&[seq as u8; 100]]).unwrap();
            log.flush().unwrap();
        }
        dev
    }

    #[test]
    fn damage_in_the_middle_is_a_hole() {
        let dev = five_flushes();
        // Flip a payload byte of record 2.
        let at = BLOCK as usize + 128 + LOG_RECORD_HEADER_BYTES + 10;
        dev.mutate(|img| img[at] ^= 1);
        let (replayed, end) = replay(&dev, 0, 1, 1);
        assert_eq!(replayed.len(), 1);
        let hole = end.hole.expect("a hole");
        assert_eq!((hole.stopped_at, hole.missing_seq), (128, 2));
        assert_eq!((hole.found_seq, hole.found_at), (3, 256));
        assert!(hole.later_flush);
        assert!(hole.to_string().contains("log record 2"), "{hole}");
    }

    #[test]
    fn dropped_duplicated_and_swapped_records_are_holes() {
        // Each case edits the 128-byte record slots of `five_flushes`.
        fn record(img: &[u8], i: usize) -> Vec<u8> {
            let at = BLOCK as usize + 128 * i;
            img[at..at + 128].to_vec()
        }
        fn put(img: &mut [u8], i: usize, bytes: &[u8]) {
            let at = BLOCK as usize + 128 * i;
            img[at..at + 128].copy_from_slice(bytes);
        }
        let dropped = |img: &mut Vec<u8>| put(img, 1, &[0; 128]);
        let duplicated = |img: &mut Vec<u8>| {
            let first = record(img, 0);
            put(img, 1, &first)
        };
        let swapped = |img: &mut Vec<u8>| {
            let (a, b) = (record(img, 1), record(img, 2));
            put(img, 1, &b);
            put(img, 2, &a)
        };
        type Mutation<'a> = &'a dyn Fn(&mut Vec<u8>);
        let cases: [(&str, Mutation); 3] = [
            ("dropped", &dropped),
            ("duplicated", &duplicated),
            ("swapped", &swapped),
        ];
        for (what, mutate) in cases {
            let dev = five_flushes();
            let mut img = dev.current_image();
            mutate(&mut img);
            let (replayed, end) = replay(&MemDevice::from_image(img), 0, 1, 1);
            assert_eq!(replayed.len(), 1, "{what}");
            let hole = end
                .hole
                .unwrap_or_else(|| panic!("{what}: no hole reported"));
            assert_eq!(hole.missing_seq, 2, "{what}");
        }
    }

    #[test]
    fn damage_within_one_flush_is_a_hole_too() {
        let (dev, log) = fresh(1);
        for seq in 1..=5 {
            log.append(seq, &[&[seq as u8; 100]]).unwrap();
        }
        log.flush().unwrap();
        let at = BLOCK as usize + 128 + LOG_RECORD_HEADER_BYTES + 10;
        dev.mutate(|img| img[at] ^= 1);
        let (replayed, end) = replay(&dev, 0, 1, 1);
        assert_eq!(replayed.len(), 1);
        let hole = end.hole.expect("a hole");
        assert!(!hole.later_flush);
        assert!(hole.to_string().contains("same flush"), "{hole}");
    }

    #[test]
    fn records_of_the_next_epoch_past_the_end_are_a_hole() {
        let (dev, log) = fresh(1);
        for seq in 1..=3 {
            log.append(seq, &[&[seq as u8; 100]]).unwrap();
        }
        log.flush().unwrap();
        // A later open (epoch 2) continued the log, and its superblock was lost.
        let next = LogWriter::new(Arc::new(dev.clone()), BLOCK, REGION, 2, 3 * 128).unwrap();
        next.append(4, &[&[4; 100]]).unwrap();
        next.flush().unwrap();
        let (replayed, end) = replay(&dev, 0, 1, 1);
        assert_eq!(replayed.len(), 3);
        let hole = end.hole.expect("a hole");
        assert_eq!((hole.found_epoch, hole.found_seq), (2, 4));
        // Replaying from the new epoch's start is clean.
        let (replayed, end) = replay(&dev, 3 * 128, 2, 4);
        assert_eq!((replayed.len(), end.hole), (1, None));
    }

    #[test]
    fn a_clean_close_does_not_look_beyond() {
        let dev = five_flushes();
        let at = BLOCK as usize + 128 + LOG_RECORD_HEADER_BYTES + 10;
        dev.mutate(|img| img[at] ^= 1);
        let quiet = ReplayStart {
            look_beyond: false,
            ..start(0, 1, 1)
        };
        let end = replay_log(&dev, BLOCK, REGION, &quiet, |_, _| Ok(())).unwrap();
        assert_eq!((end.records, end.hole), (1, None));
    }

    #[test]
    fn group_commit_from_many_threads() {
        let (dev, log) = fresh(1);
        let log = Arc::new(log);
        let seq = Arc::new(Mutex::new(1u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (log, seq) = (log.clone(), seq.clone());
                std::thread::spawn(move || {
                    for _ in 0..20 {
                        {
                            let mut s = seq.lock().unwrap();
                            log.append(*s, &[&[1; 50]]).unwrap();
                            *s += 1;
                        }
                        log.flush().unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(collect(&dev, 0, 1, 1).len(), 80);
        assert!(log.flush_count() <= 80);
    }
}

#[cfg(test)]
mod head_tests {
    use super::tests::{collect, replay, REGION};
    use super::*;
    use crate::MemDevice;
    use std::sync::mpsc;

    /// A device whose first `holds` writes (the first, or every one) each
    /// say so and wait for the test's go (a dropped sender lets every
    /// write through), so a flush can be held in flight.
    struct GatedDevice {
        inner: MemDevice,
        holds: std::sync::atomic::AtomicUsize,
        entered: Mutex<mpsc::Sender<()>>,
        go: Mutex<mpsc::Receiver<()>>,
    }

    impl Device for GatedDevice {
        fn len_bytes(&self) -> u64 {
            self.inner.len_bytes()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
            let held = self
                .holds
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if held {
                let _ = self.entered.lock().unwrap().send(());
                let _ = self.go.lock().unwrap().recv();
            }
            self.inner.write_at(buf, offset)
        }
        fn sync(&self) -> std::io::Result<()> {
            self.inner.sync()
        }
    }

    /// A gated device over `mem` holding its first `holds` writes: each
    /// says so on the first channel and waits for a go on the second.
    fn gated(
        mem: &MemDevice,
        holds: usize,
    ) -> (Arc<GatedDevice>, mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (go, go_rx) = mpsc::channel();
        let (entered_tx, entered) = mpsc::channel();
        let dev = Arc::new(GatedDevice {
            inner: mem.clone(),
            holds: std::sync::atomic::AtomicUsize::new(holds),
            entered: Mutex::new(entered_tx),
            go: Mutex::new(go_rx),
        });
        (dev, entered, go)
    }

    /// A writer held back for room in the buffer goes on once the pieces
    /// of the flush under way have taken the buffer under its bound, not
    /// when the flush ends: here the flush is still held at its third
    /// piece when both writers have their room. What the flush wrote
    /// replays whole afterwards.
    #[test]
    fn room_is_made_by_a_flush_s_pieces_before_it_ends() {
        let mem = MemDevice::new(BLOCK + REGION + BLOCK);
        let (dev, entered, go) = gated(&mem, usize::MAX);
        let log = Arc::new(LogWriter::new(dev, BLOCK, REGION, 2, 0).unwrap());
        for seq in 1..=12 {
            log.append(seq, &[&[seq as u8; 3000]]).unwrap();
        }
        let total = log.append_pos();
        assert!(total > 4 * LOG_WRITE_PIECE_BYTES);
        let flusher = {
            let log = log.clone();
            std::thread::spawn(move || log.flush())
        };
        entered.recv().unwrap();
        // Held at its first piece: nothing written, no room for less.
        let two_pieces_less = total - 2 * LOG_WRITE_PIECE_BYTES;
        let waiter = {
            let log = log.clone();
            std::thread::spawn(move || log.make_room(two_pieces_less))
        };
        assert_eq!(log.make_room(total).unwrap(), Room::Ample);
        go.send(()).unwrap();
        entered.recv().unwrap();
        go.send(()).unwrap();
        entered.recv().unwrap();
        // The flush is at its third piece, two written: the waiter has its
        // room (had the room waited for the flush, this would hang).
        let room = crate::finishes_within(std::time::Duration::from_secs(10), move || {
            waiter.join().unwrap()
        });
        assert!(
            matches!(room, Some(Ok(Room::Waited | Room::Ample))),
            "{room:?}"
        );
        assert_eq!(log.make_room(two_pieces_less).unwrap(), Room::Ample);
        assert!(
            !flusher.is_finished(),
            "the flush is held at its third piece"
        );
        assert!(log.has_unflushed(), "room says nothing of durability");
        drop(go);
        flusher.join().unwrap().unwrap();
        assert!(!log.has_unflushed());
        let out = collect(&mem, 0, 2, 1);
        assert_eq!(out.len(), 12);
        for (seq, payload) in out {
            assert_eq!(payload, vec![seq as u8; 3000]);
        }
        // With no flush under way, a writer past the bound flushes itself.
        log.append(13, &[&[13; 3000]]).unwrap();
        assert_eq!(log.make_room(0).unwrap(), Room::Flushed);
        assert!(!log.has_unflushed());
    }

    /// A checkpoint that moves the head while a flush is in flight must not
    /// leave stale bytes that make the next flush longer than the region
    /// (it would write past the log into the node region).
    #[test]
    fn head_moving_during_a_flush_never_overruns_the_region() {
        let region = 64 * 1024;
        let mem = MemDevice::new(BLOCK + region + BLOCK);
        let (dev, entered, release) = gated(&mem, 1);
        let log = Arc::new(LogWriter::new(dev, BLOCK, region, 1, 0).unwrap());
        log.append(1, &[&[1; 700]]).unwrap();
        let flusher = {
            let log = log.clone();
            std::thread::spawn(move || log.flush())
        };
        entered.recv().unwrap();
        // While that flush is held: fill, checkpoint, fill again.
        let mut seq = 2;
        while log.append(seq, &[&[seq as u8; 700]]).is_ok() {
            seq += 1;
        }
        log.set_head(log.append_pos());
        while log.append(seq, &[&[seq as u8; 700]]).is_ok() {
            seq += 1;
        }
        release.send(()).unwrap();
        flusher.join().unwrap().unwrap();
        log.flush().unwrap();
        let image = mem.current_image();
        assert!(
            image[(BLOCK + region) as usize..].iter().all(|&b| b == 0),
            "wrote past the log region"
        );
    }

    /// A flush many pieces long that wraps the region, with records
    /// appended while it writes: it writes exactly its own records (the
    /// block after them zero-padded, not holding the newer record's
    /// unchecksummed bytes), and the next flush the rest.
    #[test]
    fn a_flush_in_pieces_writes_its_records_and_only_them() {
        let mem = MemDevice::new(BLOCK + REGION + BLOCK);
        let (dev, entered, release) = gated(&mem, 1);
        // Start near the end of the region so that the flush wraps.
        let start = REGION - 3 * BLOCK;
        let log = Arc::new(LogWriter::new(dev, BLOCK, REGION, 3, start).unwrap());
        let big = |seq: u64| vec![seq as u8; 3 * BLOCK as usize + 100 * seq as usize];
        for seq in 1..=4 {
            log.append(seq, &[&big(seq)]).unwrap();
        }
        let first_end = log.append_pos();
        assert!(first_end - start > 4 * LOG_WRITE_PIECE_BYTES);
        let flusher = {
            let log = log.clone();
            std::thread::spawn(move || log.flush())
        };
        entered.recv().unwrap();
        // Held at its first piece: a fifth record lands in the same block
        // as the end of the fourth.
        log.append(5, &[&big(5)]).unwrap();
        release.send(()).unwrap();
        flusher.join().unwrap().unwrap();
        let (out, end) = replay(&mem, start, 3, 1);
        let seqs: Vec<u64> = out.iter().map(|(seq, _)| *seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4], "{end:?}");
        assert_eq!(end.hole, None);
        for (seq, payload) in &out {
            assert_eq!(*payload, big(*seq));
        }
        let image = mem.current_image();
        let tail = (BLOCK + first_end % REGION) as usize;
        let block_end = (BLOCK + first_end.div_ceil(BLOCK) * BLOCK % REGION) as usize;
        assert!(
            image[tail..block_end].iter().all(|&b| b == 0),
            "the flush wrote bytes past its records"
        );
        log.flush().unwrap();
        let out = collect(&mem, start, 3, 1);
        assert_eq!(out.len(), 5);
        assert_eq!(out[4].1, big(5));
    }
}
