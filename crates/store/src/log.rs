//! The circular redo log: a byte stream of checksummed records laid over
//! the log region, flushed with group commit.
//!
//! Positions are 64-bit stream offsets that only grow; stream position `p`
//! lives at `log_offset + p % log_bytes`. A record is
//!
//! ```text
//! off size field
//!   0    4 payload_len
//!   4    4 crc32c of bytes [8, 20 + payload_len)
//!   8    4 epoch     (the superblock's log_epoch when it was written)
//!  12    8 seq       (the batch sequence number; consecutive records +1)
//!  20    n payload   (opaque to this layer)
//! ```
//!
//! The bytes after the last record of a flush are zero up to the block end.
//! Replay starts at the superblock's `log_head` expecting `checkpoint_seq+1`
//! and stops at the first record that is torn (checksum), stale (other epoch
//! or sequence number: the previous lap of the circle) or absent (zeros).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::{crc32c_of, AlignedBuf, Device, StoreError, StoreResult, BLOCK_SIZE};

/// Bytes of a record before its payload.
pub const LOG_RECORD_HEADER_BYTES: usize = 20;
const BLOCK: u64 = BLOCK_SIZE as u64;

fn floor_block(pos: u64) -> u64 {
    pos / BLOCK * BLOCK
}

struct LogState {
    /// Oldest position still needed for recovery (the checkpoint's log head).
    head: u64,
    /// Where the next record goes.
    append_pos: u64,
    /// Everything before this position is durable.
    durable_pos: u64,
    /// Stream bytes [buf_start, append_pos) not yet durable, starting at a
    /// block boundary (so the partial tail block is rewritten whole).
    buf_start: u64,
    buf: Vec<u8>,
    flushing: bool,
    failure: Option<String>,
}

impl LogState {
    fn advance_buf_start(&mut self, to: u64) {
        if to > self.buf_start {
            let n = ((to - self.buf_start) as usize).min(self.buf.len());
            self.buf.drain(..n);
            self.buf_start += n as u64;
        }
    }
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
        let mut buf = Vec::with_capacity(1 << 20);
        if start > buf_start {
            // Keep the bytes before `start` in its block as they are on disk.
            let mut block = AlignedBuf::zeroed(BLOCK_SIZE);
            device
                .read_at(&mut block, region_offset + buf_start % region_bytes)
                .map_err(|e| StoreError::io("reading log tail", e))?;
            buf.extend_from_slice(&block[..(start - buf_start) as usize]);
        }
        Ok(LogWriter {
            device,
            region_offset,
            region_bytes,
            epoch,
            state: Mutex::new(LogState {
                head: start,
                append_pos: start,
                durable_pos: start,
                buf_start,
                buf,
                flushing: false,
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
        self.region_bytes / 4 - LOG_RECORD_HEADER_BYTES as u64
    }

    /// Bytes between the head and the append position.
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
        let s = self.lock();
        s.append_pos.saturating_sub(s.durable_pos)
    }

    pub fn bytes_written(&self) -> u64 {
        self.bytes_written.load(Ordering::Relaxed)
    }

    pub fn flush_count(&self) -> u64 {
        self.flush_count.load(Ordering::Relaxed)
    }

    /// Appends one record; returns its end position. Fails with `LogFull`
    /// when the record would overwrite the live part of the log.
    pub fn append(&self, seq: u64, payload: &[u8]) -> StoreResult<u64> {
        if payload.len() as u64 > self.max_payload() {
            return Err(StoreError::RecordTooLarge {
                bytes: payload.len() as u64,
                limit: self.max_payload(),
            });
        }
        let mut s = self.lock();
        if let Some(failure) = &s.failure {
            return Err(StoreError::Failed(failure.clone()));
        }
        let record_len = (LOG_RECORD_HEADER_BYTES + payload.len()) as u64;
        let end = s.append_pos + record_len;
        // The block holding the head is partly live; never write into it.
        if end.div_ceil(BLOCK) * BLOCK > floor_block(s.head) + self.region_bytes {
            return Err(StoreError::LogFull {
                used: s.append_pos - s.head,
                capacity: self.region_bytes,
            });
        }
        let epoch = self.epoch.to_le_bytes();
        let seq_bytes = seq.to_le_bytes();
        let crc = crc32c_of(&[&epoch, &seq_bytes, payload]);
        s.buf
            .extend_from_slice(&(payload.len() as u32).to_le_bytes());
        s.buf.extend_from_slice(&crc.to_le_bytes());
        s.buf.extend_from_slice(&epoch);
        s.buf.extend_from_slice(&seq_bytes);
        s.buf.extend_from_slice(payload);
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
        let start = s.buf_start;
        let end = s.append_pos;
        let data = AlignedBuf::from_slice(&s.buf);
        drop(s);

        let result = self.write_stream(start, &data);

        let mut s = self.lock();
        s.flushing = false;
        match &result {
            Ok(()) => {
                s.durable_pos = s.durable_pos.max(end);
                s.advance_buf_start(floor_block(end));
                // Do not keep the peak of a burst allocated.
                if s.buf.capacity() > 4 * s.buf.len().max(1 << 20) {
                    let keep = s.buf.len().max(1 << 20);
                    s.buf.shrink_to(keep);
                }
                self.flush_count.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => s.failure = Some(format!("log flush failed: {err}")),
        }
        self.flushed.notify_all();
        result
    }

    /// Writes block-aligned stream bytes starting at `start`, wrapping at
    /// the end of the region. A wrapped write is synced in order (end of the
    /// region first) so a crash never keeps the later half without the first.
    fn write_stream(&self, start: u64, data: &AlignedBuf) -> StoreResult<()> {
        assert!(
            data.len() as u64 <= self.region_bytes,
            "log write of {} bytes exceeds the {} byte region",
            data.len(),
            self.region_bytes
        );
        let physical = start % self.region_bytes;
        let first = ((self.region_bytes - physical) as usize).min(data.len());
        let io = |e| StoreError::io("writing log", e);
        self.device
            .write_at(&data[..first], self.region_offset + physical)
            .map_err(io)?;
        if first < data.len() {
            self.device.sync().map_err(io)?;
            self.device
                .write_at(&data[first..], self.region_offset)
                .map_err(io)?;
        }
        self.device.sync().map_err(io)?;
        self.bytes_written
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Moves the head to `pos` once a checkpoint containing everything
    /// before it is durable; the space before it may be reused.
    pub fn set_head(&self, pos: u64) {
        let mut s = self.lock();
        debug_assert!(pos >= s.head && pos <= s.append_pos);
        s.head = pos;
        // Records before the head are in the checkpoint: no need to write them.
        s.durable_pos = s.durable_pos.max(pos);
        // A flush in flight works on its own copy, so this is safe anyway.
        s.advance_buf_start(floor_block(pos));
    }

    /// Marks the log failed: later appends and flushes return an error.
    pub fn fail(&self, why: String) {
        let mut s = self.lock();
        s.failure.get_or_insert(why);
        self.flushed.notify_all();
    }
}

/// Where replay stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayEnd {
    /// Stream position after the last valid record.
    pub end_pos: u64,
    /// Sequence number the next record would carry.
    pub next_seq: u64,
    pub records: u64,
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

impl StreamReader<'_> {
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
                self.device
                    .read_at(
                        &mut buf[done as usize..(done + chunk) as usize],
                        self.region_offset + physical,
                    )
                    .map_err(|e| StoreError::io("reading log", e))?;
                done += chunk;
            }
            self.window_start = start;
            self.window = buf.to_vec();
        }
        let at = (pos - self.window_start) as usize;
        Ok(&self.window[at..at + len])
    }

    /// Parses the record at `pos`: `Ok(Some((seq, payload_len, intact)))`,
    /// where intact means the checksum and epoch match; `None` when there is
    /// no plausible record header there.
    fn record_at(&mut self, pos: u64, limit: u64, epoch: u32) -> StoreResult<Option<RecordAt>> {
        let header_end = pos + LOG_RECORD_HEADER_BYTES as u64;
        if header_end > limit {
            return Ok(None);
        }
        let h = self.read(pos, LOG_RECORD_HEADER_BYTES)?;
        let field = |at: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&h[at..at + 4]);
            u32::from_le_bytes(b)
        };
        let (len, crc, rec_epoch) = (field(0) as u64, field(4), field(8));
        let mut seq_raw = [0u8; 8];
        seq_raw.copy_from_slice(&h[12..20]);
        let seq = u64::from_le_bytes(seq_raw);
        if (len == 0 && crc == 0) || header_end + len > limit || len > self.region_bytes / 4 {
            return Ok(None);
        }
        let (epoch_bytes, seq_bytes) = (rec_epoch.to_le_bytes(), seq.to_le_bytes());
        let payload = self.read(header_end, len as usize)?;
        let intact = crc32c_of(&[&epoch_bytes, &seq_bytes, payload]) == crc;
        Ok(Some(RecordAt {
            seq,
            len,
            checksum_ok: intact,
            epoch_ok: rec_epoch == epoch,
        }))
    }
}

struct RecordAt {
    seq: u64,
    len: u64,
    checksum_ok: bool,
    epoch_ok: bool,
}

/// Replays the records from `head` on, calling `apply(seq, payload)` for each
/// valid record in order. Stops at the torn or stale tail. A damaged record
/// followed by a valid next one is corruption in the middle of the log and
/// returns [`StoreError::CorruptLog`] rather than silently dropping what follows.
pub fn replay_log(
    device: &dyn Device,
    region_offset: u64,
    region_bytes: u64,
    head: u64,
    epoch: u32,
    first_seq: u64,
    mut apply: impl FnMut(u64, &[u8]) -> StoreResult<()>,
) -> StoreResult<ReplayEnd> {
    let mut reader = StreamReader {
        device,
        region_offset,
        region_bytes,
        window_start: 0,
        window: Vec::new(),
    };
    let limit = floor_block(head) + region_bytes;
    let mut pos = head;
    let mut seq = first_seq;
    let mut records = 0;
    while let Some(rec) = reader.record_at(pos, limit, epoch)? {
        let next = pos + LOG_RECORD_HEADER_BYTES as u64 + rec.len;
        if !(rec.checksum_ok && rec.epoch_ok && rec.seq == seq) {
            if !rec.checksum_ok {
                if let Some(after) = reader.record_at(next, limit, epoch)? {
                    if after.checksum_ok && after.epoch_ok && after.seq == seq + 1 {
                        return Err(StoreError::CorruptLog {
                            position: pos,
                            reason: format!(
                                "record {seq} fails its checksum but record {} after it is intact",
                                seq + 1
                            ),
                        });
                    }
                }
            }
            break;
        }
        let payload = reader
            .read(pos + LOG_RECORD_HEADER_BYTES as u64, rec.len as usize)?
            .to_vec();
        apply(seq, &payload)?;
        pos = next;
        seq += 1;
        records += 1;
    }
    Ok(ReplayEnd {
        end_pos: pos,
        next_seq: seq,
        records,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CrashMode, MemDevice};

    const REGION: u64 = 64 * 1024;

    fn collect(
        dev: &MemDevice,
        head: u64,
        epoch: u32,
        first: u64,
    ) -> StoreResult<Vec<(u64, Vec<u8>)>> {
        let mut out = Vec::new();
        replay_log(dev, BLOCK, REGION, head, epoch, first, |seq, p| {
            out.push((seq, p.to_vec()));
            Ok(())
        })?;
        Ok(out)
    }

    fn payload(i: u64) -> Vec<u8> {
        vec![i as u8; (i as usize * 37) % 900 + 1]
    }

    #[test]
    fn append_flush_replay_and_wrap() {
        let dev = MemDevice::new(BLOCK + REGION + BLOCK);
        let device: Arc<dyn Device> = Arc::new(dev.clone());
        let log = LogWriter::new(device, BLOCK, REGION, 7, 0).unwrap();
        let mut head_seq = 1;
        let mut head = 0;
        for seq in 1..400u64 {
            match log.append(seq, &payload(seq)) {
                Ok(_) => {}
                Err(StoreError::LogFull { .. }) => {
                    // Pretend a checkpoint took everything so far.
                    log.flush().unwrap();
                    head = log.append_pos();
                    head_seq = seq;
                    log.set_head(head);
                    log.append(seq, &payload(seq)).unwrap();
                }
                Err(e) => panic!("{e}"),
            }
            if seq % 7 == 0 {
                log.flush().unwrap();
            }
        }
        log.flush().unwrap();
        assert!(head > REGION, "the test must wrap the log");
        let replayed = collect(&dev, head, 7, head_seq).unwrap();
        assert_eq!(replayed.len() as u64, 400 - head_seq);
        for (seq, p) in replayed {
            assert_eq!(p, payload(seq));
        }
        // A different epoch replays nothing.
        assert!(collect(&dev, head, 8, head_seq).unwrap().is_empty());
    }

    #[test]
    fn torn_tail_stops_replay_at_last_valid_record() {
        for sectors in 0..8 {
            let dev = MemDevice::new(BLOCK + REGION + BLOCK);
            let log = LogWriter::new(Arc::new(dev.clone()), BLOCK, REGION, 1, 0).unwrap();
            for seq in 1..=5 {
                log.append(seq, &[seq as u8; 1500]).unwrap();
            }
            log.flush().unwrap();
            for seq in 6..=9 {
                log.append(seq, &[seq as u8; 1500]).unwrap();
            }
            dev.fail_after_writes(0);
            assert!(log.flush().is_err());
            assert!(
                log.append(10, b"x").is_err(),
                "a failed log refuses appends"
            );
            let crashed = MemDevice::from_image(dev.crash_image(CrashMode::TearLast {
                sectors_kept: sectors,
            }));
            let replayed = collect(&crashed, 0, 1, 1).unwrap();
            // Synced records all survive; torn ones may survive only as a prefix.
            assert!(replayed.len() >= 5, "sectors {sectors}: {}", replayed.len());
            for (i, (seq, p)) in replayed.iter().enumerate() {
                assert_eq!(*seq, i as u64 + 1);
                assert_eq!(p, &vec![*seq as u8; 1500]);
            }
        }
    }

    #[test]
    fn corruption_in_the_middle_is_an_error() {
        let dev = MemDevice::new(BLOCK + REGION + BLOCK);
        let log = LogWriter::new(Arc::new(dev.clone()), BLOCK, REGION, 1, 0).unwrap();
        for seq in 1..=5 {
            log.append(seq, &[seq as u8; 100]).unwrap();
        }
        log.flush().unwrap();
        // Flip a payload byte of record 2.
        let at = BLOCK as usize + 120 + LOG_RECORD_HEADER_BYTES + 10;
        dev.mutate(|img| img[at] ^= 1);
        let err = collect(&dev, 0, 1, 1).unwrap_err();
        assert!(
            matches!(err, StoreError::CorruptLog { position: 120, .. }),
            "{err}"
        );
    }

    #[test]
    fn group_commit_from_many_threads() {
        let dev = MemDevice::new(BLOCK + REGION + BLOCK);
        let log = Arc::new(LogWriter::new(Arc::new(dev.clone()), BLOCK, REGION, 1, 0).unwrap());
        let seq = Arc::new(Mutex::new(1u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (log, seq) = (log.clone(), seq.clone());
                std::thread::spawn(move || {
                    for _ in 0..20 {
                        {
                            let mut s = seq.lock().unwrap();
                            log.append(*s, &[1; 50]).unwrap();
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
        assert_eq!(collect(&dev, 0, 1, 1).unwrap().len(), 80);
        assert!(log.flush_count() <= 80);
    }
}

#[cfg(test)]
mod head_tests {
    use super::*;
    use crate::MemDevice;
    use std::sync::mpsc;

    /// A device whose first write waits until the test lets it go, so a
    /// flush can be held in flight.
    struct GatedDevice {
        inner: MemDevice,
        gate: Mutex<Option<mpsc::Receiver<()>>>,
        entered: Mutex<Option<mpsc::Sender<()>>>,
    }

    impl Device for GatedDevice {
        fn len_bytes(&self) -> u64 {
            self.inner.len_bytes()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
            if let Some(entered) = self.entered.lock().unwrap().take() {
                entered.send(()).unwrap();
                let gate = self.gate.lock().unwrap().take().unwrap();
                gate.recv().unwrap();
            }
            self.inner.write_at(buf, offset)
        }
        fn sync(&self) -> std::io::Result<()> {
            self.inner.sync()
        }
    }

    /// A checkpoint that moves the head while a flush is in flight must not
    /// leave stale bytes that make the next flush longer than the region
    /// (it would write past the log into the node region).
    #[test]
    fn head_moving_during_a_flush_never_overruns_the_region() {
        let region = 64 * 1024;
        let mem = MemDevice::new(BLOCK + region + BLOCK);
        let (release, gate) = mpsc::channel();
        let (entered_tx, entered) = mpsc::channel();
        let dev = Arc::new(GatedDevice {
            inner: mem.clone(),
            gate: Mutex::new(Some(gate)),
            entered: Mutex::new(Some(entered_tx)),
        });
        let log = Arc::new(LogWriter::new(dev, BLOCK, region, 1, 0).unwrap());
        log.append(1, &[1; 700]).unwrap();
        let flusher = {
            let log = log.clone();
            std::thread::spawn(move || log.flush())
        };
        entered.recv().unwrap();
        // While that flush is held: fill, checkpoint, fill again.
        let mut seq = 2;
        while log.append(seq, &[seq as u8; 700]).is_ok() {
            seq += 1;
        }
        log.set_head(log.append_pos());
        while log.append(seq, &[seq as u8; 700]).is_ok() {
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
}
