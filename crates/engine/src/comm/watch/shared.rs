//! What the watchdog and the watched groups of one process share: the deadlines, the
//! recorders, the failure and its flight records.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::recorder::Recorder;
use super::remote::{ASK_WAIT, Remote};
use crate::comm::collective::Collective;
use crate::comm::watch::recorder::Entry;

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

/// What the watchdog and the watched groups of one process share.
pub(super) struct Shared {
    pub(super) config: WatchConfig,
    pub(super) recorders: Vec<Arc<Recorder>>,
    /// This process's ranks' root groups (aborting one aborts the family).
    roots: Mutex<Vec<Arc<dyn Collective>>>,
    pub(super) stop: AtomicBool,
    /// The other processes' watchdogs (under MPI).
    remote: Option<Box<dyn Remote>>,
    /// When the run began to fail (a deadline, a rank's failure), and why.
    pub(super) failed: OnceLock<(Instant, String)>,
    /// Whether the failure's flight records were written.
    dumped: AtomicBool,
    /// Whether the records were written for a stop signal.
    signalled: AtomicBool,
}

impl Shared {
    /// The state of a process whose ranks' root groups are `roots`; `off` when there is
    /// nothing to watch (no thread will look).
    pub(super) fn new(
        config: WatchConfig,
        recorders: Vec<Arc<Recorder>>,
        roots: Vec<Arc<dyn Collective>>,
        off: bool,
        remote: Option<Box<dyn Remote>>,
    ) -> Self {
        Shared {
            config,
            recorders,
            roots: Mutex::new(roots),
            stop: AtomicBool::new(off),
            remote,
            failed: OnceLock::new(),
            dumped: AtomicBool::new(false),
            signalled: AtomicBool::new(false),
        }
    }

    pub(super) fn recorder(&self, rank: usize) -> Option<&Arc<Recorder>> {
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

    pub(super) fn fail(&self, reason: &str) {
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
    pub(super) fn look(&self) {
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
