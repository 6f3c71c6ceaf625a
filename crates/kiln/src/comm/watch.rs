//! Never hang, never go unexplained: every collective and transfer of a rank is recorded in its
//! flight recorder and watched against a deadline (PyTorch's NCCL watchdog and Flight Recorder
//! do the same for its process groups).
//!
//! [`watched`] wraps each rank's group in a [`Watched`] group that numbers its collectives (per
//! group, the same on every rank), records each one's kind, group, size and dtype, when it was
//! entered and left, in the rank's [`Recorder`] (a ring of the last `dist.flight_entries`), and
//! with `dist.check_collectives` first compares that signature across the group's ranks. One
//! [`Watchdog`] thread per process looks at its ranks every 100 ms: a rank that has waited
//! past its deadline (`dist.timeout_s`, or `dist.startup_timeout_s` before its first optimizer
//! step) ends the run — the line names the collective, how long it waited and which ranks did
//! not arrive, every rank's flight record is written to `flight/rank-K.jsonl` in the run
//! directory, and the group is aborted, which wakes every waiting rank of the process with
//! that line (under MPI, the abort ends every process of the job). SIGUSR1 writes the flight
//! records of a live run; a failure writes them before the group is aborted.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use kiln_models::Activation;
use serde_json::{Value, json};

use super::{Collective, ReduceOp, pack};
use crate::error::{Error, Result};

/// What the watchdogs of a run's processes say to each other (MPI: a control communicator):
/// on a deadline, the process that waited asks every other where its ranks are; each answers
/// (writing its flight records first), so that the line names the ranks that did not arrive
/// in any process.
pub trait Remote: Send + Sync {
    /// Answers every question that has arrived with `answer(question)`.
    fn serve(&self, answer: &dyn Fn(&str) -> String);
    /// Asks every other process `question` and waits at most `wait` for the answers (serving
    /// questions meanwhile): `(process, answer)` for each that answered.
    fn ask(
        &self,
        question: &str,
        wait: Duration,
        answer: &dyn Fn(&str) -> String,
    ) -> Vec<(usize, String)>;
    /// Called (with the deadline's line) when processes did not answer after a deadline: the
    /// job is cut in parts that cannot reach each other, and this process's part ends its
    /// launcher's daemon as well, which would otherwise wait for the unreachable part.
    fn cut_off(&self, _reason: &str) {}
}

/// How a run's collectives are watched.
#[derive(Debug, Clone, Default)]
pub struct WatchConfig {
    /// The deadline of one collective or transfer (`None`: wait forever).
    pub timeout: Option<Duration>,
    /// The deadline before a rank's first optimizer step is done.
    pub startup_timeout: Option<Duration>,
    /// Collectives each rank's recorder keeps.
    pub entries: usize,
    /// Compare each collective's signature across its ranks first.
    pub check: bool,
    /// Where flight records are written (`None`: nowhere).
    pub flight_dir: Option<PathBuf>,
    /// This process's index, for the records.
    pub process: usize,
}

/// How long a process that waited past its deadline waits for the others' answers.
const ASK_WAIT: Duration = Duration::from_secs(3);

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
    entered: Instant,
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
    fn describe(&self) -> String {
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

struct Record {
    ring: VecDeque<Entry>,
    in_flight: Option<Entry>,
    /// Optimizer steps this rank has finished in this run.
    steps: usize,
    /// When the rank last left a collective or finished a step.
    since: f64,
}

/// One rank's flight recorder: its last collectives, the one it is in, and its steps.
pub struct Recorder {
    rank: usize,
    capacity: usize,
    record: Mutex<Record>,
}

impl Recorder {
    fn new(rank: usize, capacity: usize) -> Self {
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

    fn enter(&self, entry: Entry) {
        self.lock().in_flight = Some(entry);
    }

    fn leave(&self) {
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
    fn waiting(&self) -> Option<(Entry, Duration, usize)> {
        let r = self.lock();
        r.in_flight
            .as_ref()
            .map(|e| (e.clone(), e.entered.elapsed(), r.steps))
    }

    /// Where the rank is, in words.
    fn state(&self) -> String {
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
    fn is_in(&self, group: &str, seq: u64) -> bool {
        self.lock()
            .in_flight
            .as_ref()
            .is_some_and(|e| &*e.group == group && e.seq == seq)
    }

    /// The rank's flight record as JSON lines: a header, then the collectives, oldest first.
    fn lines(&self, reason: &str, process: usize) -> Vec<Value> {
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

fn hostname() -> String {
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

/// What the watchdog and the watched groups of one process share.
struct Shared {
    config: WatchConfig,
    recorders: Vec<Arc<Recorder>>,
    /// This process's ranks' root groups (aborting one aborts the family).
    roots: Mutex<Vec<Arc<dyn Collective>>>,
    stop: AtomicBool,
    /// The other processes' watchdogs (under MPI).
    remote: Option<Box<dyn Remote>>,
    /// When the run began to fail (a deadline, a rank's failure), and why.
    failed: OnceLock<(Instant, String)>,
    /// Whether the failure's flight records were written.
    dumped: AtomicBool,
    /// Whether the records were written for a stop signal.
    signalled: AtomicBool,
}

impl Shared {
    fn recorder(&self, rank: usize) -> Option<&Arc<Recorder>> {
        self.recorders.iter().find(|r| r.rank == rank)
    }

    fn deadline(&self, steps: usize) -> Option<Duration> {
        let t = self.config.timeout?;
        Some(if steps == 0 {
            self.config.startup_timeout.map_or(t, |s| s.max(t))
        } else {
            t
        })
    }

    /// Writes every rank's flight record (once for a failure; every time on demand).
    fn dump(&self, reason: &str, failure: bool) {
        if failure && self.dumped.swap(true, Ordering::SeqCst) {
            return;
        }
        let Some(dir) = &self.config.flight_dir else {
            return;
        };
        if self.config.entries == 0 {
            return;
        }
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!(
                "warning: {}: cannot write flight records: {e}",
                dir.display()
            );
            return;
        }
        for r in &self.recorders {
            let text: String = r
                .lines(reason, self.config.process)
                .iter()
                .map(|l| format!("{l}\n"))
                .collect();
            let path = dir.join(format!("rank-{}.jsonl", r.rank));
            if let Err(e) = crate::files::write_atomic(&path, text.as_bytes()) {
                eprintln!("warning: {e}");
            }
        }
    }

    fn fail(&self, reason: &str) {
        let _ = self.failed.set((Instant::now(), reason.to_string()));
        self.dump(reason, true);
    }

    /// This process's answer to another's question: where each of its ranks is (the flight
    /// records are written first, for the failure the question reports).
    fn answer(&self, question: &str) -> String {
        self.fail(question);
        let ranks: Vec<Value> = self
            .recorders
            .iter()
            .map(|r| {
                let inside = r.waiting().map(|(e, _, _)| (e.group.to_string(), e.seq));
                json!({
                    "rank": r.rank,
                    "group": inside.as_ref().map(|i| i.0.clone()),
                    "seq": inside.map(|i| i.1),
                    "state": r.state(),
                })
            })
            .collect();
        Value::Array(ranks).to_string()
    }

    /// The line of a deadline that passed for `rank` waiting in `entry`, and whether some
    /// processes did not answer; under MPI the other processes are asked where their ranks are.
    fn deadline_line(&self, rank: usize, entry: &Entry, waited: Duration) -> (String, bool) {
        let question = format!(
            "rank {rank} waited {:.1} s in {} (dist.timeout_s)",
            waited.as_secs_f64(),
            entry.describe()
        );
        let answers: Vec<Value> = self
            .remote
            .as_ref()
            .map(|r| r.ask(&question, ASK_WAIT, &|q| self.answer(q)))
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(_, text)| serde_json::from_str::<Value>(&text).ok())
            .flat_map(|v| v.as_array().cloned().unwrap_or_default())
            .collect();
        let mut absent = Vec::new();
        let mut silent = Vec::new();
        for &m in entry.members.iter() {
            if let Some(r) = self.recorder(m) {
                if !r.is_in(&entry.group, entry.seq) {
                    absent.push(format!("rank {m} ({})", r.state()));
                }
                continue;
            }
            match answers.iter().find(|a| a["rank"] == m) {
                Some(a) if a["group"] == *entry.group && a["seq"] == entry.seq => {}
                Some(a) => {
                    absent.push(format!("rank {m} ({})", a["state"].as_str().unwrap_or("?")))
                }
                None => silent.push(m.to_string()),
            }
        }
        let mut who = Vec::new();
        if !absent.is_empty() {
            who.push(format!("{} did not arrive", absent.join(", ")));
        }
        if !silent.is_empty() {
            who.push(format!(
                "the process{} of rank{} {} did not answer within {} s (cut off or stopped)",
                if silent.len() > 1 { "es" } else { "" },
                if silent.len() > 1 { "s" } else { "" },
                silent.join(", "),
                ASK_WAIT.as_secs()
            ));
        }
        let who = who.join("; ");
        let line = format!(
            "rank {rank} waited {:.1} s in {}: {who} (dist.timeout_s = {}); flight records in {}",
            waited.as_secs_f64(),
            entry.describe(),
            self.config.timeout.map_or(0.0, |t| t.as_secs_f64()),
            self.config
                .flight_dir
                .as_ref()
                .map_or("no directory".into(), |d| d.display().to_string()),
        );
        (line, !silent.is_empty())
    }

    /// One look at every rank: a deadline that passed ends the run.
    fn look(&self) {
        if crate::signal::take_dump_request() {
            self.dump("SIGUSR1", false);
        }
        // A stop signal may be the launcher taking the job down (a lost daemon, a scheduler's
        // limit): the records are written first, in case the process does not get to stop.
        if let Some(signal) = crate::signal::requested()
            && !self.signalled.swap(true, Ordering::SeqCst)
        {
            self.dump(&crate::signal::name(signal), false);
        }
        if let Some(remote) = &self.remote {
            remote.serve(&|q| self.answer(q));
        }
        if self.failed.get().is_some() {
            return;
        }
        let overdue = self
            .recorders
            .iter()
            .filter_map(|r| {
                let (entry, waited, steps) = r.waiting()?;
                let deadline = self.deadline(steps)?;
                (waited > deadline).then_some((r.rank, entry, waited))
            })
            .max_by(|a, b| a.2.cmp(&b.2));
        if let Some((rank, entry, waited)) = overdue {
            let (line, cut) = self.deadline_line(rank, &entry, waited);
            self.fail(&line);
            if cut && let Some(remote) = &self.remote {
                remote.cut_off(&line);
            }
            let roots = self.roots.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(root) = roots.first() {
                root.abort(&line);
            }
        }
    }
}

/// The process's watchdog thread (stopped when dropped) and what it watches.
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// The recorder of this process's `local`-th rank.
    pub fn recorder(&self, local: usize) -> Arc<Recorder> {
        self.shared.recorders[local].clone()
    }

    /// When and why the run began to fail, if it did.
    pub fn failed(&self) -> Option<(Duration, String)> {
        self.shared
            .failed
            .get()
            .map(|(t, why)| (t.elapsed(), why.clone()))
    }

    /// Notes that the run fails for `reason` (writing the flight records once).
    pub fn fail(&self, reason: &str) {
        self.shared.fail(reason);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Wraps each of this process's rank groups `comms` (the world, one per device thread) in a
/// [`Watched`] group, and starts the watchdog. With no deadline, no flight entries and no
/// checks there is nothing to watch: the groups are returned as they are and no thread starts.
pub fn watched(
    comms: Vec<Box<dyn Collective>>,
    config: WatchConfig,
    remote: Option<Box<dyn Remote>>,
) -> (Vec<Box<dyn Collective>>, Watchdog) {
    let recorders: Vec<Arc<Recorder>> = comms
        .iter()
        .map(|c| Arc::new(Recorder::new(c.rank(), config.entries)))
        .collect();
    let off = config.timeout.is_none() && config.entries == 0 && !config.check;
    let (plain, roots): (_, Vec<Arc<dyn Collective>>) = if off {
        (Some(comms), Vec::new())
    } else {
        (None, comms.into_iter().map(Arc::from).collect())
    };
    let shared = Arc::new(Shared {
        config,
        recorders,
        roots: Mutex::new(roots.clone()),
        stop: AtomicBool::new(off),
        remote,
        failed: OnceLock::new(),
        dumped: AtomicBool::new(false),
        signalled: AtomicBool::new(false),
    });
    if let Some(comms) = plain {
        let watchdog = Watchdog {
            shared,
            thread: None,
        };
        return (comms, watchdog);
    }
    let groups = roots
        .into_iter()
        .enumerate()
        .map(|(local, inner)| {
            let world = inner.world_size();
            Box::new(Watched {
                inner,
                recorder: shared.recorders[local].clone(),
                shared: shared.clone(),
                group: Arc::from("world"),
                members: Arc::new((0..world).collect()),
                seq: AtomicU64::new(0),
                transfers: AtomicU64::new(0),
                splits: AtomicU64::new(0),
            }) as Box<dyn Collective>
        })
        .collect();
    let watching = shared.clone();
    let thread = std::thread::Builder::new()
        .name("kiln-watchdog".into())
        .spawn(move || {
            while !watching.stop.load(Ordering::SeqCst) {
                watching.look();
                // Woken early when the watchdog is dropped.
                std::thread::park_timeout(Duration::from_millis(100));
            }
        })
        .expect("spawn the watchdog thread");
    (
        groups,
        Watchdog {
            shared,
            thread: Some(thread),
        },
    )
}

/// A group whose collectives are numbered, recorded and watched; see the module
/// documentation.
pub struct Watched {
    inner: Arc<dyn Collective>,
    recorder: Arc<Recorder>,
    shared: Arc<Shared>,
    group: Arc<str>,
    members: Arc<Vec<usize>>,
    /// Collectives of this group so far (the same count on every rank).
    seq: AtomicU64,
    /// Transfers this rank made in this group (numbered on their own: ranks make different
    /// numbers of them).
    transfers: AtomicU64,
    splits: AtomicU64,
}

/// A collective's signature as the ranks compare it: kind, sequence number, elements, dtype.
fn signature(kind: &str, seq: u64, elements: usize, dtype: &str) -> [u64; 4] {
    let code = |s: &str| {
        s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        }) >> 16
    };
    [code(kind), seq, elements as u64, code(dtype)]
}

impl Watched {
    /// Runs `op` on the inner group as collective `kind` of `elements` `dtype` values: numbered,
    /// recorded, checked against the other ranks' signatures when asked.
    fn run<T>(
        &self,
        kind: &'static str,
        elements: usize,
        dtype: &'static str,
        peer: Option<usize>,
        op: impl FnOnce(&dyn Collective) -> Result<T>,
    ) -> Result<T> {
        let seq = match peer {
            Some(_) => self.transfers.fetch_add(1, Ordering::Relaxed),
            None => self.seq.fetch_add(1, Ordering::Relaxed),
        };
        self.recorder.enter(Entry {
            seq,
            kind,
            group: self.group.clone(),
            members: self.members.clone(),
            elements,
            dtype,
            peer: peer.map(|p| self.members[p]),
            start: now(),
            end: None,
            entered: Instant::now(),
        });
        let outcome = if self.shared.config.check && peer.is_none() {
            self.check(kind, seq, elements, dtype)
                .and_then(|()| op(&*self.inner))
        } else {
            op(&*self.inner)
        };
        self.recorder.leave();
        outcome
    }

    /// Fails if another rank of the group is about to run a different collective.
    fn check(&self, kind: &str, seq: u64, elements: usize, dtype: &str) -> Result<()> {
        if self.inner.world_size() == 1 {
            return Ok(());
        }
        let mine = signature(kind, seq, elements, dtype);
        let all = pack::gather_counts(&*self.inner, &mine)?;
        let Some((r, theirs)) = all.iter().enumerate().find(|(_, s)| **s != mine) else {
            return Ok(());
        };
        // The other rank's words: its kind and dtype are known only as codes, so name what
        // differs.
        let differs: Vec<String> = [
            ("kind", mine[0] != theirs[0]),
            ("sequence number", mine[1] != theirs[1]),
            ("elements", mine[2] != theirs[2]),
            ("dtype", mine[3] != theirs[3]),
        ]
        .iter()
        .filter(|(_, d)| *d)
        .map(|(w, _)| w.to_string())
        .collect();
        Err(Error::Worker(format!(
            "mismatched collectives in group {}: rank {} runs {kind} #{seq} of {elements} {dtype}, \
             rank {} runs #{} of {} elements; they differ in {} (dist.check_collectives)",
            self.group,
            self.members[self.inner.rank()],
            self.members[r],
            theirs[1],
            theirs[2],
            differs.join(" and ")
        )))
    }
}

impl Collective for Watched {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce(&self, data: &mut [f32], op: ReduceOp) -> Result<()> {
        self.run("all_reduce", data.len(), "f32", None, |c| {
            c.all_reduce(data, op)
        })
    }

    fn all_reduce_bf16(&self, data: &mut [burn::tensor::bf16], op: ReduceOp) -> Result<()> {
        self.run("all_reduce", data.len(), "bf16", None, |c| {
            c.all_reduce_bf16(data, op)
        })
    }

    fn broadcast(&self, data: &mut Vec<f32>, root: usize) -> Result<()> {
        // Only the root knows the length: the others' signatures say 0.
        let n = if self.inner.rank() == root {
            data.len()
        } else {
            0
        };
        let elements = if self.shared.config.check { 0 } else { n };
        self.run("broadcast", elements, "f32", None, |c| {
            c.broadcast(data, root)
        })
    }

    fn all_gather(&self, data: &[f32]) -> Result<Vec<f32>> {
        // Ranks may gather vectors of different lengths: the signature leaves the length out.
        let elements = if self.shared.config.check {
            0
        } else {
            data.len()
        };
        self.run("all_gather", elements, "f32", None, |c| c.all_gather(data))
    }

    fn reduce_scatter(&self, data: &[f32], op: ReduceOp) -> Result<Vec<f32>> {
        self.run("reduce_scatter", data.len(), "f32", None, |c| {
            c.reduce_scatter(data, op)
        })
    }

    fn reduce_scatter_bf16(
        &self,
        data: &[burn::tensor::bf16],
        op: ReduceOp,
    ) -> Result<Vec<burn::tensor::bf16>> {
        self.run("reduce_scatter", data.len(), "bf16", None, |c| {
            c.reduce_scatter_bf16(data, op)
        })
    }

    fn barrier(&self) -> Result<()> {
        self.run("barrier", 0, "none", None, |c| c.barrier())
    }

    fn abort(&self, reason: &str) {
        // What every rank was doing when the run failed is written before the group goes.
        self.shared.fail(reason);
        self.inner.abort(reason);
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
        let number = self.splits.fetch_add(1, Ordering::Relaxed);
        let all = self.run("split", 2, "u64", None, |c| {
            pack::gather_counts(c, &[color as u64, key as u64])
        })?;
        let mut same: Vec<(u64, usize)> = all
            .iter()
            .enumerate()
            .filter(|(_, ck)| ck[0] == color as u64)
            .map(|(r, ck)| (ck[1], r))
            .collect();
        same.sort_unstable();
        let members = same.iter().map(|(_, r)| self.members[*r]).collect();
        let inner = self.run("split", 0, "none", None, |c| c.split(color, key))?;
        Ok(Box::new(Watched {
            inner: Arc::from(inner),
            recorder: self.recorder.clone(),
            shared: self.shared.clone(),
            group: Arc::from(format!("{}/split{number}:{color}", self.group)),
            members: Arc::new(members),
            seq: AtomicU64::new(0),
            transfers: AtomicU64::new(0),
            splits: AtomicU64::new(0),
        }))
    }

    fn send(&self, to: usize, value: Activation) -> Result<()> {
        let n = value.dims().iter().product();
        self.run("send", n, "activation", Some(to), |c| c.send(to, value))
    }

    fn recv(&self, from: usize) -> Result<Activation> {
        self.run("recv", 0, "activation", Some(from), |c| c.recv(from))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::world_group;

    /// Runs `body(rank, group)` on a watched in-process group of `n` ranks, one thread each.
    fn on_ranks<T: Send>(
        n: usize,
        config: WatchConfig,
        body: impl Fn(usize, &dyn Collective) -> T + Sync,
    ) -> Vec<T> {
        let (groups, _watchdog) = watched(world_group(n).unwrap(), config, None);
        std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .iter()
                .enumerate()
                .map(|(r, g)| {
                    let body = &body;
                    s.spawn(move || body(r, &**g))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn mismatched_collectives_are_one_line_error_naming_both_ranks() {
        let config = WatchConfig {
            check: true,
            ..WatchConfig::default()
        };
        let outcomes = on_ranks(2, config, |rank, g| {
            g.all_reduce(&mut [1.0; 4], ReduceOp::Sum)?;
            // The second collective differs in size between the ranks.
            let mut data = vec![1.0; 3 + 2 * rank];
            g.all_reduce(&mut data, ReduceOp::Sum)
        });
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            let message = outcome.unwrap_err().to_string();
            assert_eq!(message.lines().count(), 1, "{message}");
            let other = 1 - rank;
            let (mine, theirs) = if rank == 0 { (3, 5) } else { (5, 3) };
            assert!(
                message.contains(&format!("rank {rank} runs all_reduce #1 of {mine} f32")),
                "{message}"
            );
            assert!(
                message.contains(&format!("rank {other} runs #1 of {theirs} elements")),
                "{message}"
            );
            assert!(message.contains("differ in elements"), "{message}");
        }
    }

    #[test]
    fn the_same_collectives_pass_the_check() {
        let config = WatchConfig {
            check: true,
            ..WatchConfig::default()
        };
        let sums = on_ranks(3, config, |rank, g| {
            let mut data = vec![rank as f32; 5];
            g.all_reduce(&mut data, ReduceOp::Sum).unwrap();
            let gathered = g.all_gather(&vec![1.0; rank + 1]).unwrap();
            (data[0], gathered.len())
        });
        assert_eq!(sums, vec![(3.0, 6); 3]);
    }

    #[test]
    fn a_rank_that_never_arrives_ends_the_collective_at_its_deadline_naming_it() {
        let dir = std::env::temp_dir().join(format!("kiln-watch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = WatchConfig {
            timeout: Some(Duration::from_millis(300)),
            entries: 16,
            flight_dir: Some(dir.clone()),
            ..WatchConfig::default()
        };
        let started = Instant::now();
        let outcomes = on_ranks(2, config, |rank, g| {
            g.barrier()?;
            if rank == 1 {
                // Rank 1 stays away from the next collective past the deadline.
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(());
            }
            g.all_reduce(&mut [1.0; 7], ReduceOp::Sum)
        });
        let took = started.elapsed();
        let message = outcomes[0].as_ref().unwrap_err().to_string();
        assert!(took < Duration::from_secs(3), "took {took:?}");
        assert_eq!(message.lines().count(), 1, "{message}");
        assert!(
            message.contains("all_reduce #1 of world (7 f32)"),
            "{message}"
        );
        assert!(message.contains("rank 1 ("), "{message}");
        for rank in 0..2 {
            let text = std::fs::read_to_string(dir.join(format!("rank-{rank}.jsonl"))).unwrap();
            assert!(text.lines().count() >= 2, "{text}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
