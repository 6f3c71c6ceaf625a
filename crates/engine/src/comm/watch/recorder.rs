//! Each rank's flight recorder: a ring of its last collectives and transfers, with when
//! each was entered and left.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::MutexGuard;
use std::time::Duration;

/// Seconds since the Unix epoch.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One collective or transfer as a rank's recorder keeps it.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Its number in its group (the same on every rank of the group).
    pub seq: u64,
    /// `all_reduce`, `all_gather`, `send`, …
    pub kind: &'static str,
    /// The group's name (`world`, `world/split0:1`).
    pub group: Arc<str>,
    /// The group's ranks, as global ranks.
    pub members: Arc<Vec<usize>>,
    /// Elements this rank contributed.
    pub elements: usize,
    /// Their dtype.
    pub dtype: &'static str,
    /// The other rank of a transfer (a global rank).
    pub peer: Option<usize>,
    /// When it was entered (seconds since the Unix epoch).
    pub start: f64,
    /// When it was left.
    pub end: Option<f64>,
    pub(super) entered: Instant,
}

impl Entry {
    fn to_json(&self) -> Value {
        json!({
            "seq": self.seq,
            "kind": self.kind,
            "group": &*self.group,
            "members": &*self.members,
            "elements": self.elements,
            "dtype": self.dtype,
            "peer": self.peer,
            "start": self.start,
            "end": self.end,
        })
    }

    /// `all_reduce #37 of world (1234 f32)`.
    pub(super) fn describe(&self) -> String {
        describe(&self.to_json())
    }
}

/// A recorded collective (an entry of a flight record) in words: `all_reduce #37 of world
/// (1234 f32)`, `send #3 of world with rank 2 (512 activation)`.
pub fn describe(e: &Value) -> String {
    let peer = e["peer"]
        .as_u64()
        .map_or(String::new(), |p| format!(" with rank {p}"));
    format!(
        "{} #{} of {}{peer} ({} {})",
        e["kind"].as_str().unwrap_or("?"),
        e["seq"],
        e["group"].as_str().unwrap_or("?"),
        e["elements"],
        e["dtype"].as_str().unwrap_or("?")
    )
}

pub(super) struct Record {
    ring: VecDeque<Entry>,
    in_flight: Option<Entry>,
    /// Optimizer steps this rank has finished in this run.
    steps: usize,
    /// When the rank last left a collective or finished a step.
    since: f64,
}

/// One rank's flight recorder: its last collectives, the one it is in, and its steps.
pub struct Recorder {
    pub(super) rank: usize,
    capacity: usize,
    record: Mutex<Record>,
}

impl Recorder {
    pub(super) fn new(rank: usize, capacity: usize) -> Self {
        Self {
            rank,
            capacity,
            record: Mutex::new(Record {
                ring: VecDeque::with_capacity(capacity),
                in_flight: None,
                steps: 0,
                since: now(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The rank's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Counts an optimizer step the rank finished.
    pub fn step_done(&self) {
        let mut r = self.lock();
        r.steps += 1;
        r.since = now();
    }

    pub(super) fn enter(&self, entry: Entry) {
        self.lock().in_flight = Some(entry);
    }

    pub(super) fn leave(&self) {
        let mut r = self.lock();
        if let Some(mut e) = r.in_flight.take() {
            let t = now();
            e.end = Some(t);
            r.since = t;
            if self.capacity > 0 {
                if r.ring.len() == self.capacity {
                    r.ring.pop_front();
                }
                r.ring.push_back(e);
            }
        }
    }

    /// The collective the rank is in and how long it has waited, with its steps done.
    pub(super) fn waiting(&self) -> Option<(Entry, Duration, usize)> {
        let r = self.lock();
        r.in_flight
            .as_ref()
            .map(|e| (e.clone(), e.entered.elapsed(), r.steps))
    }

    /// Where the rank is, in words.
    pub(super) fn state(&self) -> String {
        let r = self.lock();
        match &r.in_flight {
            Some(e) => format!(
                "in {} for {:.1} s",
                e.describe(),
                e.entered.elapsed().as_secs_f64()
            ),
            None => {
                let last = r
                    .ring
                    .back()
                    .map_or(String::new(), |e| format!(" since {}", e.describe()));
                format!(
                    "{} steps done, out of collectives for {:.1} s{last}",
                    r.steps,
                    now() - r.since
                )
            }
        }
    }

    /// Whether the rank is in collective `seq` of `group`.
    pub(super) fn is_in(&self, group: &str, seq: u64) -> bool {
        self.lock()
            .in_flight
            .as_ref()
            .is_some_and(|e| &*e.group == group && e.seq == seq)
    }

    /// The rank's flight record as JSON lines: a header, then the collectives, oldest first.
    pub(super) fn lines(&self, reason: &str, process: usize) -> Vec<Value> {
        let r = self.lock();
        let mut out = vec![json!({
            "rank": self.rank,
            "process": process,
            "host": hostname(),
            "written": now(),
            "reason": reason,
            "steps": r.steps,
            "since": r.since,
            "in_flight": r.in_flight.as_ref().map(Entry::to_json),
        })];
        out.extend(r.ring.iter().map(Entry::to_json));
        out
    }
}

/// This machine's host name (`unknown` where the system does not say).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its length; gethostname NUL-terminates within it or
    // truncates, and we read up to the first NUL.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    if !ok {
        return "unknown".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}
