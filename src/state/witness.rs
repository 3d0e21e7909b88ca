//! The *witness* of the sled backend: a small checksummed record kept outside
//! sled — the number of the last group commit and every mark as of that commit.
//!
//! sled alone cannot promise that a reopened store has every committed mark: on
//! recovery it treats the first message that fails its checksum as a torn write
//! and silently drops it and everything after it, so one flipped byte in the
//! middle of `db` reopens with older marks, or none (measured: tests/it/disk.rs).
//! Each commit stores its number in sled, flushes, and only then rewrites the
//! witness, so sled is never behind a witness it wrote; at start-up a sled that is
//! behind its witness (an older commit number, or a lower mark) has lost committed
//! writes and is refused. The witness alternates between two files, so a write
//! torn by a power loss leaves the other, one commit older, intact. It is not
//! synced itself: after a power loss it may lag sled, never lead it.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use sha2::{Digest, Sha256};

pub(super) const FILES: [&str; 2] = ["witness.0", "witness.1"];
const MAGIC: &[u8; 8] = b"FGWITNS1";

#[derive(Debug, PartialEq, Eq)]
pub(super) struct Witness {
    pub seq: u64,
    pub marks: Vec<(Vec<u8>, u64)>,
}

/// `MAGIC, seq u64, n u32, n × (len u16, lease, mark u64), SHA-256 of the rest`.
pub(super) fn encode(seq: u64, marks: &[(Vec<u8>, u64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(52 + marks.len() * 80);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&seq.to_be_bytes());
    out.extend_from_slice(&(marks.len() as u32).to_be_bytes());
    for (lease, mark) in marks {
        out.extend_from_slice(&(lease.len() as u16).to_be_bytes());
        out.extend_from_slice(lease);
        out.extend_from_slice(&mark.to_be_bytes());
    }
    let sum = Sha256::digest(&out);
    out.extend_from_slice(&sum);
    out
}

pub(super) fn decode(raw: &[u8]) -> Option<Witness> {
    let (body, sum) = raw.split_at_checked(raw.len().checked_sub(32)?)?;
    if Sha256::digest(body)[..] != sum[..] || !body.starts_with(MAGIC) {
        return None;
    }
    let mut r = &body[MAGIC.len()..];
    let mut take = |n: usize| -> Option<&[u8]> {
        let (a, b) = r.split_at_checked(n)?;
        r = b;
        Some(a)
    };
    let seq = u64::from_be_bytes(take(8)?.try_into().ok()?);
    let n = u32::from_be_bytes(take(4)?.try_into().ok()?);
    let mut marks = Vec::new();
    for _ in 0..n {
        let len = u16::from_be_bytes(take(2)?.try_into().ok()?);
        let lease = take(usize::from(len))?.to_vec();
        marks.push((lease, u64::from_be_bytes(take(8)?.try_into().ok()?)));
    }
    r.is_empty().then_some(Witness { seq, marks })
}

/// The newest valid witness; `None` when both files are absent or empty.
pub(super) fn read(dir: &Path) -> Result<Option<Witness>, String> {
    let mut best: Option<Witness> = None;
    let mut invalid = Vec::new();
    for name in FILES {
        let raw = match std::fs::read(dir.join(name)) {
            Ok(raw) => raw,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("reading the witness {name}: {e}")),
        };
        if raw.is_empty() {
            continue;
        }
        match decode(&raw) {
            Some(w) if best.as_ref().is_none_or(|b| b.seq < w.seq) => best = Some(w),
            Some(_) => {}
            None => invalid.push(name),
        }
    }
    match best {
        // One slot torn or damaged: the other is at most one commit older.
        Some(w) => Ok(Some(w)),
        None if invalid.is_empty() => Ok(None),
        None => Err(format!(
            "the witness is unreadable ({} failed its checksum)",
            invalid.join(" and ")
        )),
    }
}

pub(super) struct Writer {
    files: [File; 2],
}

impl Writer {
    pub(super) fn open(dir: &Path) -> std::io::Result<Writer> {
        let open = |name: &str| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(dir.join(name))
        };
        Ok(Writer {
            files: [open(FILES[0])?, open(FILES[1])?],
        })
    }

    /// Overwrites the slot of `seq` (the other keeps the previous commit).
    pub(super) fn write(&self, seq: u64, marks: &[(Vec<u8>, u64)]) -> std::io::Result<()> {
        let buf = encode(seq, marks);
        let f = &self.files[(seq % 2) as usize];
        f.write_all_at(&buf, 0)?;
        if f.metadata()?.len() > buf.len() as u64 {
            f.set_len(buf.len() as u64)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn witness_codec_round_trips_and_rejects_damage() {
        let marks = vec![(b"billing".to_vec(), 7), (b"a".to_vec(), u64::MAX)];
        let raw = encode(42, &marks);
        assert_eq!(decode(&raw), Some(Witness { seq: 42, marks }));
        for i in 0..raw.len() {
            let mut b = raw.clone();
            b[i] ^= 1;
            assert_eq!(decode(&b), None, "flip at {i}");
            assert_eq!(decode(&raw[..i]), None, "cut at {i}");
        }
    }
}
