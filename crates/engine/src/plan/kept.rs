//! The planner's measurements, kept between launches. A prediction rests on measurements —
//! the process's bytes before any rank, the probe's points, the collectives' seconds — and
//! measurements differ a little from launch to launch; a launch near a memory limit would then
//! be refused once and accepted the next time. So the first launch of a model on a machine
//! keeps what it measured, and every later launch of the same model, data and settings on the
//! same machine and build reads it back instead of measuring again: the same command is
//! decided the same way every time (and starts sooner). A point not kept yet (another
//! micro-batch, precision or strategy) is measured and added.
//!
//! The entry's file is named by a hash of everything the measurements depend on: the build
//! (the program's path, size and time), the host, its cores and devices, the processes, the
//! model's parameters and the workload's settings (`Signature`). `hardware.plan_cache =
//! false` measures on every launch and keeps nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::links::Links;
use super::probe::Point;
use crate::metrics::PlanRecord;

/// Entries older than this are measured again (a machine's speed drifts over weeks: kernels,
/// drivers, what else runs there).
const MAX_AGE_S: u64 = 30 * 24 * 3600;

/// Entries the folder keeps at most (the oldest go first).
const MAX_ENTRIES: usize = 256;

/// One entry: what was measured for one signature.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct Entry {
    /// The signature's text, for a reader of the file.
    pub about: String,
    /// Seconds since the Unix epoch of the entry's first measurement.
    pub since: u64,
    /// The process's heap bytes and its resident bytes beyond the heap before any rank.
    pub floor: Option<(f64, f64)>,
    /// The collectives' seconds on the run's ranks.
    pub links: Option<Links>,
    /// Probe points by [`point_id`].
    pub points: BTreeMap<String, Point>,
}

/// Where a plan's measurements come from and go, for `train plan` and the JSON.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Keeping {
    /// The entry's file; `None` where measurements are not kept (`hardware.plan_cache =
    /// false`, no cache folder, or a process other than 0).
    pub file: Option<PathBuf>,
    /// Seconds since the Unix epoch of the entry's first measurement.
    pub since: u64,
    /// Whether every measurement this plan used was read back (nothing measured now).
    pub reused: bool,
    /// Why nothing is kept, or why keeping failed.
    pub notice: Option<String>,
}

/// After a run whose prediction read its measurements back whole (`record.kept`): when the
/// run's own peak (`measured_mib`, its resident set) is above the predicted one by more than
/// `headroom` of the prediction — the share a limit keeps free, so that a limit set by that
/// prediction would not have held — the kept measurements are not to be trusted over a fresh
/// one (they were made while the machine was quieter, or by another build of the same size):
/// their file is removed, and the next launch measures again and keeps that. A prediction
/// above the peak is left: it errs on the side a limit is safe on, and dropping it would make
/// the same command decided differently from launch to launch. What was done, in words;
/// `None` where nothing was.
pub fn check_kept(record: &PlanRecord, measured_mib: Option<f64>, headroom: f64) -> Option<String> {
    let (file, measured) = (record.kept.as_ref()?, measured_mib?);
    let predicted = record.peak_rss_mib;
    if !(predicted > 0.0 && measured > predicted * (1.0 + headroom)) {
        return None;
    }
    let done = match std::fs::remove_file(file) {
        Ok(()) => "dropped: the next launch measures again".to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "already gone".to_string(),
        Err(e) => format!("not dropped ({e})"),
    };
    Some(format!(
        "the kept measurements ({}) predicted a peak of {predicted:.0} MiB and the run's was \
         {measured:.0} MiB ({:+.0} %, beyond the {:.0} % a limit keeps free): {done}",
        file.display(),
        100.0 * (measured / predicted - 1.0),
        100.0 * headroom
    ))
}

/// The kept measurements of one signature, read at the start of a plan and written at its end.
pub(crate) struct Kept {
    file: Option<PathBuf>,
    entry: Entry,
    notice: Option<String>,
}

impl Kept {
    /// Nothing kept, nothing read (`why` says so, where the user asked otherwise).
    pub fn off(why: Option<String>) -> Self {
        Self {
            file: None,
            entry: Entry {
                since: now(),
                ..Entry::default()
            },
            notice: why,
        }
    }

    /// The entry of `signature` in the cache folder (`$KILN_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`), read if it is there and young enough.
    pub fn open(signature: &str) -> Self {
        match folder() {
            Some(dir) => Self::open_in(&dir, signature),
            None => Self::off(Some(
                "no cache folder (set KILN_CACHE_DIR or HOME): measured on every launch".into(),
            )),
        }
    }

    /// The entry of `signature` in the cache folder `dir`.
    pub fn open_in(dir: &Path, signature: &str) -> Self {
        let hash = Sha256::digest(signature.as_bytes());
        let name: String = hash[..12].iter().map(|b| format!("{b:02x}")).collect();
        let file = dir.join("plans").join(format!("{name}.json"));
        let entry = std::fs::read(&file)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<Entry>(&bytes).ok())
            .filter(|e| e.about == signature && now().saturating_sub(e.since) < MAX_AGE_S)
            .unwrap_or_else(|| Entry {
                about: signature.to_string(),
                since: now(),
                ..Entry::default()
            });
        Self {
            file: Some(file),
            entry,
            notice: None,
        }
    }

    /// What is kept now.
    pub fn entry(&self) -> &Entry {
        &self.entry
    }

    /// Adds what this launch measured and writes the entry (temporary file and rename, so a
    /// reader sees the old entry or the new one). A failure to write is said in the notice,
    /// not fatal: the run goes on, and the next launch measures again.
    pub fn store(&mut self, fresh: &Entry) -> Keeping {
        let mut changed = false;
        if self.entry.floor.is_none() && fresh.floor.is_some() {
            self.entry.floor = fresh.floor;
            changed = true;
        }
        if self.entry.links.is_none() && fresh.links.is_some() {
            self.entry.links = fresh.links;
            changed = true;
        }
        for (id, p) in &fresh.points {
            if !self.entry.points.contains_key(id) {
                self.entry.points.insert(id.clone(), *p);
                changed = true;
            }
        }
        if changed && let Some(file) = &self.file {
            if let Err(e) = write(file, &self.entry) {
                self.notice = Some(format!(
                    "could not keep the planner's measurements in {}: {e}; the next launch \
                     measures again",
                    file.display()
                ));
            }
            if let Some(plans) = file.parent() {
                prune(plans, file);
            }
        }
        Keeping {
            file: self.file.clone(),
            since: self.entry.since,
            reused: !changed && self.file.is_some(),
            notice: self.notice.clone(),
        }
    }
}

/// A probe point's name in an entry: its probe key (strategy, precision, recompute), its
/// micro-batch, and the shape of its ranks (threads and per-core sub-replicas; a pipeline's
/// cuts where the config sets them).
pub(crate) fn point_id(key: &str, batch: usize, ranks: usize, sub: usize, cuts: &str) -> String {
    format!("{key}@{batch} ranks={ranks} sub={sub}{cuts}")
}

/// The cache folder, if there is one.
pub(crate) fn folder() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("KILN_CACHE_DIR") {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("kiln"));
    }
    var("HOME").map(|home| PathBuf::from(home).join(".cache").join("kiln"))
}

/// Writes `entry` through a temporary file of this writer's own (processes and threads may
/// write the same entry at once: the last rename wins, each file whole) and a rename.
fn write(file: &Path, entry: &Entry) -> std::io::Result<()> {
    static WRITES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = file.parent().expect("an entry lives in a folder");
    std::fs::create_dir_all(dir)?;
    let bytes = serde_json::to_vec_pretty(entry).expect("an entry serialises");
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = file.with_extension(format!("tmp-{}-{n}", std::process::id()));
    crate::files::write_synced(&tmp, &bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
    std::fs::rename(&tmp, file).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Removes entries past [`MAX_AGE_S`] and the oldest beyond [`MAX_ENTRIES`] (never `keep`).
fn prune(plans: &Path, keep: &Path) {
    let Ok(read) = std::fs::read_dir(plans) else {
        return;
    };
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = read
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json") && p != keep)
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .collect();
    files.sort();
    let too_many = (files.len() + 1).saturating_sub(MAX_ENTRIES);
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(MAX_AGE_S);
    for (i, (modified, path)) in files.iter().enumerate() {
        if i < too_many || *modified < old {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Seconds since the Unix epoch.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The build this process runs: its program's path, size and modification time (a rebuilt
/// program measures again).
pub(crate) fn build_identity() -> String {
    let exe = std::env::current_exe().ok();
    let meta = exe.as_ref().and_then(|e| std::fs::metadata(e).ok());
    let modified = meta
        .as_ref()
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    format!(
        "kiln {} program {} size {} modified {modified}",
        env!("CARGO_PKG_VERSION"),
        exe.map_or_else(|| "?".into(), |e| e.display().to_string()),
        meta.map_or(0, |m| m.len()),
    )
}

/// The machine: its host name, its CPU's model and its memory.
pub(crate) fn machine_identity() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .next()
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_default();
    format!(
        "host {} cpu {cpu:?} {memory}",
        crate::comm::watch::hostname()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(batch: usize, bytes: f64) -> Point {
        Point {
            batch,
            step_bytes: bytes,
            ..Point::default()
        }
    }

    #[test]
    fn an_entry_is_read_back_exactly_and_grows_by_what_is_new() {
        let dir = std::env::temp_dir().join(format!("kiln-kept-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let open = |s: &str| Kept::open_in(&dir, s);
        let mut first = open("model a");
        assert!(first.entry().points.is_empty());
        let odd = 1.0 / 3.0 * 1e7;
        let mut fresh = Entry {
            floor: Some((odd, 0.1)),
            ..Entry::default()
        };
        fresh.points.insert("k@4".into(), point(4, odd));
        let kept = first.store(&fresh);
        assert!(!kept.reused && kept.file.is_some() && kept.notice.is_none());
        // Read back: the same bits.
        let mut second = open("model a");
        assert_eq!(second.entry().floor, Some((odd, 0.1)));
        assert_eq!(
            second.entry().points["k@4"].step_bytes.to_bits(),
            odd.to_bits()
        );
        // Nothing new: reused, nothing written. A new point is added beside the old.
        assert!(second.store(&Entry::default()).reused);
        let mut more = Entry::default();
        more.points.insert("k@8".into(), point(8, 2.0));
        more.points.insert("k@4".into(), point(4, 99.0));
        assert!(!second.store(&more).reused);
        let third = open("model a");
        assert_eq!(third.entry().points.len(), 2);
        assert_eq!(
            third.entry().points["k@4"].step_bytes,
            odd,
            "a kept point stays"
        );
        // Another signature has an entry of its own.
        assert!(open("model b").entry().points.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn kept_measurements_that_predicted_too_low_a_peak_are_dropped_and_others_stay() {
        let dir = std::env::temp_dir().join(format!("kiln-kept-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("entry.json");
        let record = |kept: bool| PlanRecord {
            peak_rss_mib: 250.0,
            kept: kept.then(|| file.clone()),
            ..PlanRecord::default()
        };
        let check = |r: &PlanRecord, measured| check_kept(r, measured, 0.10);
        std::fs::write(&file, b"{}").unwrap();
        // Within the headroom, above the peak (the safe side), no kept file, no measured
        // peak: left alone.
        for measured in [Some(270.0), Some(150.0), None] {
            assert_eq!(check(&record(true), measured), None);
        }
        assert_eq!(check(&record(false), Some(400.0)), None);
        assert!(file.exists());
        // Low by 14 %: dropped, and said.
        let said = check(&record(true), Some(285.0)).expect("a peak above the headroom is said");
        assert!(!file.exists(), "{said}");
        assert!(
            said.contains("250 MiB") && said.contains("285 MiB"),
            "{said}"
        );
        assert!(said.contains("+14 %") && said.contains("dropped"), "{said}");
        // Gone already: said so.
        let again = check(&record(true), Some(285.0)).unwrap();
        assert!(again.contains("already gone"), "{again}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
