//! One run directory, one run: `run.lock` in a run directory names the process that holds it
//! (its host, process id, and since when), and a second `train`, `train --resume` or
//! `train launch` into that directory is refused while the holder lives. A holder that is gone
//! is taken over: on its own host, a process that no longer runs (its id and start time
//! checked, so that a reused id does not count); seen from another host, a lease not renewed
//! for [`LEASE`] — the holder rewrites the file every [`RENEW_EVERY`], so the lock works
//! across machines on a shared filesystem as on one (the hosts' clocks agreeing within the
//! lease). `train launch` holds the lock for the whole job and lets the trainers it starts in
//! through [`HELD_VAR`].

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::files::write_atomic;

/// The lock's file in a run directory.
pub const LOCK_FILE: &str = "run.lock";
/// The file whose creation makes one process at a time the one that takes a gone holder's lock
/// over.
const TAKEOVER_FILE: &str = "run.lock.takeover";
/// The environment variable through which `train launch` lets the trainers it starts into the
/// run directory it holds: the lock's token.
pub const HELD_VAR: &str = "KILN_RUN_LOCK";
/// How often a holder renews its lease.
pub const RENEW_EVERY: Duration = Duration::from_secs(10);
/// How long a lease lasts without renewal, seen from another host.
pub const LEASE: Duration = Duration::from_secs(60);

/// Who holds a run directory: what `run.lock` says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Holder {
    /// The program: `train` or `train launch`.
    pub program: String,
    /// The host it runs on.
    pub host: String,
    /// Its process id there.
    pub pid: u32,
    /// When the process started, in clock ticks after boot (Linux), which tells a reused
    /// process id from the holder.
    #[serde(default)]
    pub process_start: Option<u64>,
    /// When it took the lock, in seconds after the Unix epoch.
    pub since_unix_s: u64,
    /// When it last renewed the lease, in seconds after the Unix epoch.
    pub renewed_unix_s: u64,
    /// What tells this holding from any other.
    pub token: String,
}

impl Holder {
    fn me(program: &str) -> Self {
        let now = now_s();
        let pid = std::process::id();
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let host = crate::comm::watch::hostname();
        Self {
            program: program.to_string(),
            token: format!("{host}-{pid}-{now}-{nanos}"),
            host,
            pid,
            process_start: process_start(pid),
            since_unix_s: now,
            renewed_unix_s: now,
        }
    }

    /// `train on host h, process 12, since 2026-11-26 21:03:12 UTC`.
    pub fn describe(&self) -> String {
        format!(
            "{} on host {}, process {}, since {}",
            self.program,
            self.host,
            self.pid,
            utc(self.since_unix_s)
        )
    }

    /// Whether this holder is gone, seen from `here` at `now`: why, if it is.
    pub fn gone(&self, here: &str, now: u64) -> Option<String> {
        if self.host == here {
            let alive = match (process_start(self.pid), self.process_start) {
                (Some(now_start), Some(then)) => now_start == then,
                (found, _) => found.is_some() || pid_exists(self.pid),
            };
            return (!alive).then(|| format!("process {} no longer runs", self.pid));
        }
        let age = now.saturating_sub(self.renewed_unix_s);
        (age > LEASE.as_secs()).then(|| {
            format!(
                "its lease was last renewed {age} s ago (it renews every {} s; a lease lasts {} s)",
                RENEW_EVERY.as_secs(),
                LEASE.as_secs()
            )
        })
    }
}

/// A held run directory: the lock is renewed while this lives and removed when it drops.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    token: String,
    /// Held by the launcher that started this process: neither renewed nor removed here.
    inherited: bool,
    stop: Option<Sender<()>>,
    renewer: Option<std::thread::JoinHandle<()>>,
    /// The gone holder this one took over, and why it counted as gone.
    pub took_over: Option<(Holder, String)>,
}

/// The run directories of this process that another holder took over while they ran (their
/// lease lapsed), with that holder, once the renewer has seen it.
static LOST: Mutex<Vec<(PathBuf, Holder)>> = Mutex::new(Vec::new());

/// The holder that took `run_dir` over from this process, if one has: the run must stop
/// writing there.
pub fn lost(run_dir: &Path) -> Option<Holder> {
    let path = run_dir.join(LOCK_FILE);
    let lost = LOST.lock().ok()?;
    lost.iter()
        .find(|(p, _)| *p == path)
        .map(|(_, h)| h.clone())
}

impl RunLock {
    /// Takes `run_dir` (which exists) for `program`: refused in one line naming the holder when
    /// a live one holds it; a gone holder's lock is taken over (said in `took_over`). A process
    /// that `train launch` started, which holds the directory, gets it without a lock of its own.
    pub fn acquire(run_dir: &Path, program: &str) -> Result<Self> {
        let path = run_dir.join(LOCK_FILE);
        if let Some(holder) = read(&path)?
            && started_by(&holder)
        {
            return Ok(Self {
                path,
                token: holder.token,
                inherited: true,
                stop: None,
                renewer: None,
                took_over: None,
            });
        }
        let me = Holder::me(program);
        let mut took_over = None;
        for _ in 0..50 {
            match create(&path, &me) {
                Ok(()) => {
                    let (stop, stopped) = channel();
                    let (file, token) = (path.clone(), me.token.clone());
                    let renewer = std::thread::Builder::new()
                        .name("kiln-run-lock".into())
                        .spawn(move || renew(&file, me, &stopped, RENEW_EVERY))
                        .map_err(|e| Error::io(&path, e))?;
                    return Ok(Self {
                        path,
                        token,
                        inherited: false,
                        stop: Some(stop),
                        renewer: Some(renewer),
                        took_over,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Error::io(&path, e)),
            }
            match read(&path)? {
                // Removed since: try again.
                None => continue,
                Some(holder) => match holder.gone(&me.host, now_s()) {
                    None => return Err(refusal(run_dir, &holder)),
                    Some(why) => {
                        if take_over(run_dir, &holder)? {
                            took_over = Some((holder, why));
                        }
                    }
                },
            }
        }
        Err(Error::config(format!(
            "{}: cannot take {LOCK_FILE}: other processes keep taking it",
            run_dir.display()
        )))
    }

    /// Refuses when a live holder other than this process's launcher holds `run_dir`; changes
    /// nothing.
    pub fn check(run_dir: &Path) -> Result<()> {
        let path = run_dir.join(LOCK_FILE);
        let Some(holder) = read(&path)? else {
            return Ok(());
        };
        if started_by(&holder) {
            return Ok(());
        }
        match holder.gone(&crate::comm::watch::hostname(), now_s()) {
            None => Err(refusal(run_dir, &holder)),
            Some(_) => Ok(()),
        }
    }

    /// The token that lets the processes this one starts into the directory ([`HELD_VAR`]).
    pub fn token(&self) -> &str {
        &self.token
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        if self.inherited {
            return;
        }
        drop(self.stop.take());
        if let Some(renewer) = self.renewer.take() {
            let _ = renewer.join();
        }
        // Only this holder's own lock goes: one that took it over keeps it.
        if read(&self.path)
            .ok()
            .flatten()
            .is_some_and(|h| h.token == self.token)
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Whether `holder` is the launcher that started this process ([`HELD_VAR`] is its token).
fn started_by(holder: &Holder) -> bool {
    std::env::var(HELD_VAR).is_ok_and(|t| t == holder.token)
}

fn refusal(run_dir: &Path, holder: &Holder) -> Error {
    Error::config(format!(
        "{}: a live run holds this directory: {} ({}); wait for it to end or stop it, or \
         choose another directory",
        run_dir.display(),
        holder.describe(),
        run_dir.join(LOCK_FILE).display()
    ))
}

/// Creates the lock file, failing with `AlreadyExists` when there is one.
fn create(path: &Path, me: &Holder) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    let json = serde_json::to_vec_pretty(me).expect("a holder serialises");
    file.write_all(&json)?;
    file.sync_all()
}

/// The lock's holder, `None` when there is no lock. A lock being written (empty or cut short)
/// is read again for up to a second; one that still does not read is a holder that died
/// writing it, and counts as gone.
fn read(path: &Path) -> Result<Option<Holder>> {
    for _ in 0..10 {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(path, e)),
        };
        if let Ok(holder) = serde_json::from_slice(&bytes) {
            return Ok(Some(holder));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(Some(Holder {
        program: "an unreadable lock".to_string(),
        host: crate::comm::watch::hostname(),
        pid: 0,
        process_start: None,
        since_unix_s: 0,
        renewed_unix_s: 0,
        token: String::new(),
    }))
}

/// Removes the lock of `gone`, which was judged gone, unless another process is taking it over
/// or already has; one process at a time does (the takeover file), judging the lock again
/// first. Returns whether this process removed it.
fn take_over(run_dir: &Path, gone: &Holder) -> Result<bool> {
    let path = run_dir.join(LOCK_FILE);
    let guard = run_dir.join(TAKEOVER_FILE);
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&guard)
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            // A taker killed between its two steps leaves the file: it goes after a while.
            let old = std::fs::metadata(&guard)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > Duration::from_secs(10));
            if old {
                let _ = std::fs::remove_file(&guard);
            } else {
                std::thread::sleep(Duration::from_millis(100));
            }
            return Ok(false);
        }
        Err(e) => return Err(Error::io(&guard, e)),
    }
    let removed = match read(&path) {
        Ok(Some(now)) if now.token == gone.token => {
            std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
            true
        }
        _ => false,
    };
    let _ = std::fs::remove_file(&guard);
    Ok(removed)
}

/// The renewer: rewrites the lease `every` ([`RENEW_EVERY`]) until told to stop; a lock that names
/// another holder (which took a lapsed lease over) is recorded in [`LOST`] and left alone.
fn renew(path: &Path, mut me: Holder, stop: &Receiver<()>, every: Duration) {
    loop {
        match stop.recv_timeout(every) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        match read(path) {
            Ok(Some(holder)) if holder.token != me.token => {
                if let Ok(mut lost) = LOST.lock() {
                    lost.push((path.to_path_buf(), holder));
                }
                return;
            }
            Ok(_) => {
                me.renewed_unix_s = now_s();
                let json = serde_json::to_vec_pretty(&me).expect("a holder serialises");
                if let Err(e) = write_atomic(path, &json) {
                    eprintln!("warning: cannot renew the run's lock: {e}");
                }
            }
            Err(e) => eprintln!("warning: cannot read the run's lock: {e}"),
        }
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// When process `pid` started, in clock ticks after boot (field 22 of `/proc/PID/stat`);
/// `None` where it does not run or there is no `/proc`.
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19)?.parse().ok()
}

/// Whether a process `pid` exists, where `/proc` does not tell.
fn pid_exists(pid: u32) -> bool {
    if Path::new("/proc/self/stat").exists() {
        return false;
    }
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 checks that the process exists and sends nothing.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// `2026-11-26 21:03:12 UTC` for seconds after the Unix epoch.
pub fn utc(unix_s: u64) -> String {
    let (days, secs) = (unix_s / 86_400, unix_s % 86_400);
    // Days to a civil date (the proleptic Gregorian calendar), by 400-year eras.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory, removed when the test drops it.
    struct Dir(PathBuf);

    impl std::ops::Deref for Dir {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("kiln-lock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    fn write(dir: &Path, holder: &Holder) {
        let json = serde_json::to_vec(holder).unwrap();
        std::fs::write(dir.join(LOCK_FILE), json).unwrap();
    }

    #[test]
    fn dates_read_as_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_795_726_992), "2026-11-26 21:03:12 UTC");
    }

    #[test]
    fn a_live_holder_refuses_and_its_lock_goes_when_it_drops() {
        let d = dir("live");
        let held = RunLock::acquire(&d, "train").unwrap();
        assert!(held.took_over.is_none());
        let e = RunLock::acquire(&d, "train").unwrap_err().to_string();
        let host = crate::comm::watch::hostname();
        let pid = std::process::id();
        assert!(
            e.contains(&format!("train on host {host}, process {pid}, since ")),
            "{e}"
        );
        assert!(e.contains("run.lock") && !e.contains('\n'), "{e}");
        assert!(RunLock::check(&d).is_err());
        drop(held);
        assert!(!d.join(LOCK_FILE).exists());
        RunLock::check(&d).unwrap();
        let again = RunLock::acquire(&d, "train").unwrap();
        assert!(again.took_over.is_none());
    }

    #[test]
    fn a_gone_holder_is_taken_over_and_a_renewed_one_elsewhere_is_not() {
        let d = dir("gone");
        let mut me = Holder::me("train");
        // A process of this host that ended: its id exited, or a reused id started later.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        me.pid = child.id();
        me.process_start = Some(1);
        me.token = "dead".into();
        write(&d, &me);
        let taken = RunLock::acquire(&d, "train").unwrap();
        let (holder, why) = taken.took_over.clone().unwrap();
        assert_eq!(holder.token, "dead");
        assert!(why.contains("no longer runs"), "{why}");
        drop(taken);
        // Another host: its lease decides.
        let now = now_s();
        let mut far = Holder::me("train launch");
        far.host = "elsewhere".into();
        far.renewed_unix_s = now - 5;
        write(&d, &far);
        let e = RunLock::acquire(&d, "train").unwrap_err().to_string();
        assert!(e.contains("train launch on host elsewhere"), "{e}");
        far.renewed_unix_s = now - LEASE.as_secs() - 5;
        write(&d, &far);
        let taken = RunLock::acquire(&d, "train").unwrap();
        assert!(taken.took_over.as_ref().unwrap().1.contains("lease"));
    }

    #[test]
    fn the_renewer_rewrites_the_lease_with_the_time_of_renewal() {
        let d = dir("renewed");
        let mut me = Holder::me("train");
        // A lease last renewed at the epoch: seen from another host, long lapsed.
        me.renewed_unix_s = 0;
        create(&d.join(LOCK_FILE), &me).unwrap();
        let before = now_s();
        let (stop, stopped) = channel();
        let (file, mine) = (d.join(LOCK_FILE), me.clone());
        let renewer =
            std::thread::spawn(move || renew(&file, mine, &stopped, Duration::from_millis(20)));
        let until = std::time::Instant::now() + Duration::from_secs(10);
        let renewed = loop {
            let held = read(&d.join(LOCK_FILE)).unwrap().unwrap();
            if held.renewed_unix_s != 0 {
                break held;
            }
            assert!(std::time::Instant::now() < until, "never renewed");
            std::thread::sleep(Duration::from_millis(10));
        };
        drop(stop);
        renewer.join().unwrap();
        // The same holder, its lease dated now: another host would not take it over.
        assert_eq!(renewed.token, me.token);
        assert!(renewed.renewed_unix_s >= before && renewed.renewed_unix_s <= now_s());
        assert!(renewed.gone("elsewhere", now_s()).is_none());
        assert!(me.gone("elsewhere", now_s()).is_some());
        assert!(lost(&d).is_none());
    }

    #[test]
    fn a_holder_whose_lock_was_taken_over_knows_it() {
        let d = dir("lost");
        let me = Holder::me("train");
        create(&d.join(LOCK_FILE), &me).unwrap();
        let (stop, stopped) = channel();
        let (file, mine) = (d.join(LOCK_FILE), me.clone());
        let renewer =
            std::thread::spawn(move || renew(&file, mine, &stopped, Duration::from_millis(20)));
        // Renewed while it is its own.
        std::thread::sleep(Duration::from_millis(100));
        assert!(lost(&d).is_none());
        let mut other = me.clone();
        other.token = "another".into();
        // Written until the renewer has read it (a renewal may land over one write).
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while lost(&d).is_none() {
            assert!(
                std::time::Instant::now() < until,
                "the renewer never saw it"
            );
            write(&d, &other);
            std::thread::sleep(Duration::from_millis(30));
        }
        // The renewer stops: it never writes over the holder that took the lock.
        renewer.join().unwrap();
        drop(stop);
        assert_eq!(lost(&d).unwrap().token, "another");
    }

    #[test]
    fn the_launchers_token_lets_its_trainer_in_without_a_lock_of_its_own() {
        let d = dir("inherit");
        let launcher = RunLock::acquire(&d, "train launch").unwrap();
        // SAFETY: this test alone reads or writes the variable.
        unsafe { std::env::set_var(HELD_VAR, launcher.token()) };
        let trainer = RunLock::acquire(&d, "train");
        // SAFETY: as above.
        unsafe { std::env::remove_var(HELD_VAR) };
        drop(trainer.unwrap());
        // The trainer's end leaves the launcher's lock.
        assert!(d.join(LOCK_FILE).exists());
        assert!(RunLock::acquire(&d, "train").is_err());
    }
}
