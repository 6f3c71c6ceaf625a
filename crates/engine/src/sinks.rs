//! Extra metric sinks besides `metrics.jsonl`: `metrics.csv` and TensorBoard event files.
//!
//! The TensorBoard writer is kiln's own: an event file is a sequence of TFRecord frames
//! (length, masked CRC-32C of the length, payload, masked CRC-32C of the payload) whose
//! payloads are `Event` protocol buffers holding scalar `Summary` values. [`read_scalars`]
//! parses such a file back, which the tests use to check what was written.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Columns of `metrics.csv` (training and validation records), in order; a record's missing
/// keys are left empty.
pub const CSV_COLUMNS: &[&str] = &[
    "step",
    "epoch",
    "split",
    "loss",
    "accuracy",
    "lr",
    "samples_per_sec",
    "tokens_per_sec",
    "time_data",
    "time_compute",
    "time_sync",
    "time_optim",
    "samples_per_sec_ema",
    "tokens_per_sec_ema",
    "samples_per_sec_per_device",
    "tokens_per_sec_per_device",
    "mfu",
    "pct_data",
    "pct_compute",
    "pct_sync",
    "pct_optim",
    "slowest_rank",
    "rank_skew",
];

/// Writes one CSV row per metrics record, under a fixed header.
pub struct CsvSink {
    path: PathBuf,
    columns: Vec<String>,
    out: BufWriter<File>,
}

impl CsvSink {
    /// Creates `run_dir/metrics.csv`, keeping the rows of an earlier run up to step
    /// `keep_until` when resuming.
    pub fn open(run_dir: &Path, keep_until: Option<usize>) -> Result<Self> {
        let columns = CSV_COLUMNS.iter().map(|c| c.to_string()).collect();
        Self::create(&run_dir.join("metrics.csv"), columns, keep_until)
    }

    /// Creates `path` with `columns` (the first of which is the step), keeping the rows of an
    /// earlier file with the same header up to step `keep_until` when resuming.
    pub fn create(path: &Path, columns: Vec<String>, keep_until: Option<usize>) -> Result<Self> {
        let mut columns = columns;
        let mut header = columns.join(",");
        let kept: Vec<String> = match keep_until {
            Some(limit) if path.exists() => {
                let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
                let mut lines = text.lines();
                let first = lines.next();
                // A header that goes on past these columns carries a run's named metrics,
                // which the resumed run writes again.
                if let Some(longer) = first.filter(|h| h.starts_with(&format!("{header},"))) {
                    columns = longer.split(',').map(str::to_string).collect();
                    header = longer.to_string();
                }
                if first == Some(header.as_str()) {
                    lines
                        .filter(|row| {
                            row.split(',')
                                .next()
                                .and_then(|s| s.parse::<usize>().ok())
                                .is_some_and(|s| s <= limit)
                        })
                        .map(str::to_string)
                        .collect()
                } else {
                    Vec::new()
                }
            }
            _ => Vec::new(),
        };
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        let mut out = BufWriter::new(file);
        writeln!(out, "{header}").map_err(|e| Error::io(path, e))?;
        for row in kept {
            writeln!(out, "{row}").map_err(|e| Error::io(path, e))?;
        }
        Ok(Self {
            path: path.to_path_buf(),
            columns,
            out,
        })
    }

    /// Appends `record` as a row.
    pub fn write(&mut self, record: &Map<String, Value>) -> Result<()> {
        // Named metrics (listed under `metrics`) get columns of their own when they first
        // appear.
        let new: Vec<String> = record
            .get("metrics")
            .and_then(Value::as_array)
            .map(|names| {
                names
                    .iter()
                    .filter_map(Value::as_str)
                    .filter(|n| !self.columns.iter().any(|c| c == n))
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        if !new.is_empty() {
            self.add_columns(new)?;
        }
        let cells: Vec<String> = self
            .columns
            .iter()
            .map(|c| match record.get(c) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(v) => v.to_string(),
            })
            .collect();
        writeln!(self.out, "{}", cells.join(","))
            .and_then(|()| self.out.flush())
            .map_err(|e| Error::io(&self.path, e))
    }
}

impl CsvSink {
    /// Rewrites the file with `new` columns after the present ones (empty in earlier rows).
    fn add_columns(&mut self, new: Vec<String>) -> Result<()> {
        self.out.flush().map_err(|e| Error::io(&self.path, e))?;
        let text = std::fs::read_to_string(&self.path).map_err(|e| Error::io(&self.path, e))?;
        self.columns.extend(new.iter().cloned());
        let pad = ",".repeat(new.len());
        let mut body = self.columns.join(",");
        body.push('\n');
        for row in text.lines().skip(1) {
            body.push_str(row);
            body.push_str(&pad);
            body.push('\n');
        }
        let tmp = self.path.with_extension("csv.tmp");
        std::fs::write(&tmp, body).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| Error::io(&self.path, e))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(|e| Error::io(&self.path, e))?;
        self.out = BufWriter::new(file);
        Ok(())
    }
}

/// Writes every numeric value of a record as a TensorBoard scalar tagged `split/key`.
pub struct TensorBoardSink {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TensorBoardSink {
    /// Creates a new event file under `run_dir/tb/`.
    pub fn open(run_dir: &Path) -> Result<Self> {
        let dir = run_dir.join("tb");
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let path = dir.join(format!(
            "events.out.tfevents.{}.kiln.{}",
            now.as_secs(),
            std::process::id()
        ));
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut sink = Self {
            path,
            out: BufWriter::new(file),
        };
        // The first event names the format version, as readers expect.
        let mut event = Vec::new();
        put_double(&mut event, 1, now.as_secs_f64());
        put_bytes(&mut event, 3, b"brain.Event:2");
        sink.frame(&event)?;
        Ok(sink)
    }

    /// Appends the numeric values of `record` at its `step`.
    pub fn write(&mut self, record: &Map<String, Value>) -> Result<()> {
        let step = record.get("step").and_then(Value::as_i64).unwrap_or(0);
        let split = record
            .get("split")
            .and_then(Value::as_str)
            .unwrap_or("train");
        let mut summary = Vec::new();
        for (key, value) in record {
            if matches!(key.as_str(), "step" | "epoch" | "split") {
                continue;
            }
            if let Some(x) = value.as_f64() {
                let mut v = Vec::new();
                put_bytes(&mut v, 1, format!("{split}/{key}").as_bytes());
                put_float(&mut v, 2, x as f32);
                put_bytes(&mut summary, 1, &v);
            }
        }
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let mut event = Vec::new();
        put_double(&mut event, 1, wall);
        put_varint_field(&mut event, 2, step as u64);
        put_bytes(&mut event, 5, &summary);
        self.frame(&event)?;
        self.out.flush().map_err(|e| Error::io(&self.path, e))
    }

    fn frame(&mut self, payload: &[u8]) -> Result<()> {
        let len = (payload.len() as u64).to_le_bytes();
        let mut frame = Vec::with_capacity(payload.len() + 16);
        frame.extend_from_slice(&len);
        frame.extend_from_slice(&masked_crc(&len).to_le_bytes());
        frame.extend_from_slice(payload);
        frame.extend_from_slice(&masked_crc(payload).to_le_bytes());
        self.out
            .write_all(&frame)
            .map_err(|e| Error::io(&self.path, e))
    }
}

/// One scalar read back from an event file.
#[derive(Debug, Clone, PartialEq)]
pub struct Scalar {
    /// Tag, `split/key`.
    pub tag: String,
    /// Step.
    pub step: i64,
    /// Value.
    pub value: f32,
}

/// Reads every scalar of a TensorBoard event file, checking every frame's checksums.
pub fn read_scalars(path: &Path) -> Result<Vec<Scalar>> {
    let bad = |what: &str| Error::Io(format!("{}: bad event file: {what}", path.display()));
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let mut scalars = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + 12)
            .ok_or_else(|| bad("truncated frame header"))?;
        let len = u64::from_le_bytes(header[..8].try_into().expect("8 bytes")) as usize;
        if masked_crc(&header[..8]) != u32::from_le_bytes(header[8..12].try_into().expect("4")) {
            return Err(bad("length checksum mismatch"));
        }
        let payload = bytes
            .get(at + 12..at + 12 + len)
            .ok_or_else(|| bad("truncated payload"))?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or_else(|| bad("truncated payload checksum"))?;
        if masked_crc(payload) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(bad("payload checksum mismatch"));
        }
        at += 16 + len;
        let mut step = 0;
        let mut summary = None;
        for (field, value) in fields(payload).ok_or_else(|| bad("malformed event"))? {
            match (field, value) {
                (2, Field::Varint(v)) => step = v as i64,
                (5, Field::Bytes(b)) => summary = Some(b),
                _ => {}
            }
        }
        let Some(summary) = summary else { continue };
        for (field, value) in fields(summary).ok_or_else(|| bad("malformed summary"))? {
            let (1, Field::Bytes(v)) = (field, value) else {
                continue;
            };
            let mut tag = String::new();
            let mut x = None;
            for (f, val) in fields(v).ok_or_else(|| bad("malformed value"))? {
                match (f, val) {
                    (1, Field::Bytes(b)) => tag = String::from_utf8_lossy(b).into_owned(),
                    (2, Field::Fixed32(bits)) => x = Some(f32::from_bits(bits)),
                    _ => {}
                }
            }
            if let Some(value) = x {
                scalars.push(Scalar { tag, step, value });
            }
        }
    }
    Ok(scalars)
}

enum Field<'a> {
    Varint(u64),
    Fixed64,
    Fixed32(u32),
    Bytes(&'a [u8]),
}

/// Splits a protocol-buffer message into `(field number, value)` pairs.
fn fields(mut b: &[u8]) -> Option<Vec<(u64, Field<'_>)>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b)?;
        let value = match key & 7 {
            0 => Field::Varint(varint(&mut b)?),
            1 => {
                let (_, rest) = b.split_at_checked(8)?;
                b = rest;
                Field::Fixed64
            }
            2 => {
                let n = varint(&mut b)? as usize;
                let (v, rest) = b.split_at_checked(n)?;
                b = rest;
                Field::Bytes(v)
            }
            5 => {
                let (v, rest) = b.split_at_checked(4)?;
                b = rest;
                Field::Fixed32(u32::from_le_bytes(v.try_into().ok()?))
            }
            _ => return None,
        };
        out.push((key >> 3, value));
    }
    Some(out)
}

fn varint(b: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = b.split_first()?;
        *b = rest;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_varint_field(out: &mut Vec<u8>, field: u64, v: u64) {
    put_varint(out, field << 3);
    put_varint(out, v);
}

fn put_double(out: &mut Vec<u8>, field: u64, v: f64) {
    put_varint(out, (field << 3) | 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_float(out: &mut Vec<u8>, field: u64, v: f32) {
    put_varint(out, (field << 3) | 5);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u64, v: &[u8]) {
    put_varint(out, (field << 3) | 2);
    put_varint(out, v.len() as u64);
    out.extend_from_slice(v);
}

/// CRC-32C (Castagnoli), bitwise; event files are small enough not to need a table.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0x82F6_3B78 & mask);
        }
    }
    !crc
}

/// The rotated-and-offset CRC that TFRecord frames store.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xA282_EAD8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn crc32c_matches_the_published_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn event_files_round_trip_and_detect_corruption() {
        let dir = std::env::temp_dir().join(format!("kiln-tb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut sink = TensorBoardSink::open(&dir).unwrap();
        let rec = |step: i64, loss: f64| {
            json!({"step": step, "epoch": 0, "split": "train", "loss": loss, "lr": 0.5})
                .as_object()
                .unwrap()
                .clone()
        };
        sink.write(&rec(1, 2.5)).unwrap();
        sink.write(&rec(300, 0.25)).unwrap();
        drop(sink);
        let file = std::fs::read_dir(dir.join("tb"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let scalars = read_scalars(&file).unwrap();
        assert_eq!(scalars.len(), 4);
        assert!(scalars.contains(&Scalar {
            tag: "train/loss".into(),
            step: 300,
            value: 0.25
        }));
        assert!(scalars.contains(&Scalar {
            tag: "train/lr".into(),
            step: 1,
            value: 0.5
        }));
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 1;
        std::fs::write(&file, bytes).unwrap();
        assert!(read_scalars(&file).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn csv_rows_follow_the_columns_and_resume_keeps_earlier_steps() {
        let dir = std::env::temp_dir().join(format!("kiln-csv-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let rec = |step: i64| {
            json!({"step": step, "split": "val", "loss": 1.5, "accuracy": 0.75})
                .as_object()
                .unwrap()
                .clone()
        };
        let mut sink = CsvSink::open(&dir, None).unwrap();
        sink.write(&rec(5)).unwrap();
        sink.write(&rec(10)).unwrap();
        drop(sink);
        let mut sink = CsvSink::open(&dir, Some(5)).unwrap();
        sink.write(&rec(6)).unwrap();
        drop(sink);
        let text = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
        let rows: Vec<&str> = text.lines().collect();
        assert_eq!(rows[0], CSV_COLUMNS.join(","));
        let empty = ",".repeat(CSV_COLUMNS.len() - 5);
        assert_eq!(rows[1], format!("5,,val,1.5,0.75{empty}"));
        assert_eq!(rows[2], format!("6,,val,1.5,0.75{empty}"));
        assert_eq!(rows.len(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
