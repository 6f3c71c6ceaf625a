//! The launcher's loop: start the run, wait for it with an ear for signals, decide from its
//! exit code, and start it again on the hosts that answer.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;

use super::args::{LaunchArgs, RESTARTS_FILE};
use super::hosts::{answering, configured};
use super::split::{Split, keep_samples};
use crate::checkpoint;
use crate::error::{Error, Result, exit};
use crate::files::write_atomic;
use crate::runlock::{HELD_VAR, LOCK_FILE, RunLock};
use crate::trainer::{ATTEMPT_VAR, FAULT_ATTEMPTS_VAR, FAULT_VAR};

/// The agent used to check hosts when none is given (and `mpirun`'s own default).
const SSH: &str = "ssh -o BatchMode=yes -o ConnectTimeout=5";
/// The longest back-off between restarts.
const MAX_BACKOFF: f64 = 60.0;

/// Runs `train launch`; returns the exit code: the run's own when it is final (0 done, 2
/// refused, 3 stopped by a signal, 5 diverged), 4 when the restarts ran out.
pub fn run(args: &LaunchArgs) -> i32 {
    match Agent::new(args) {
        Ok(agent) => agent.run(),
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}

/// How one attempt ended.
struct Ended {
    /// The exit code (128 + the signal for a process a signal ended).
    code: i32,
    /// The last `error:` line it printed.
    error: Option<String>,
    /// Whether the launcher forwarded a stop signal to it.
    signalled: bool,
}

struct Agent<'a> {
    args: &'a LaunchArgs,
    exe: PathBuf,
    hosts: Vec<String>,
    agent: String,
}

impl<'a> Agent<'a> {
    fn new(args: &'a LaunchArgs) -> Result<Self> {
        for own in ["--run-dir", "--resume"] {
            if args
                .train
                .iter()
                .any(|a| a == own || a.starts_with(&format!("{own}=")))
            {
                return Err(Error::config(format!(
                    "train launch: {own} among train's arguments: the launcher takes the run \
                     directory itself (train launch --run-dir DIR -- ...) and resumes it"
                )));
            }
        }
        let exe = std::env::current_exe()
            .map_err(|e| Error::config(format!("train launch: cannot find this program: {e}")))?;
        let hosts = configured(&args.hosts, args.hostfile.as_deref())?;
        let agent = args.rsh_agent.clone().unwrap_or_else(|| SSH.to_string());
        Ok(Self {
            args,
            exe,
            hosts,
            agent,
        })
    }

    fn run_dir(&self) -> &Path {
        &self.args.run_dir
    }

    fn run(self) -> i32 {
        crate::signal::install();
        let _lock = match self.hold() {
            Ok(lock) => lock,
            Err(e) => {
                eprintln!("error: train launch: {e}");
                return e.exit_code();
            }
        };
        let mut hosts = self.answering();
        if !self.hosts.is_empty() && hosts.is_empty() {
            eprintln!(
                "error: train launch: none of the hosts answers `{} HOST true`: {}",
                self.agent,
                self.hosts.join(", ")
            );
            return exit::REFUSED;
        }
        let mut failures = Vec::new();
        let mut split = None;
        let mut attempt = 0;
        loop {
            let resume = checkpoint::newest_whole(self.run_dir()).is_ok();
            let ended = match self.attempt(attempt, &hosts, resume, split) {
                Ok(ended) => ended,
                Err(e) => {
                    eprintln!("error: train launch: {e}");
                    return exit::FAILED;
                }
            };
            let failed_at = Instant::now();
            match ended.code {
                _ if ended.signalled => return ended.code,
                exit::DONE => {
                    self.count_restarts(attempt);
                    return exit::DONE;
                }
                exit::REFUSED | exit::DIVERGED | exit::STOPPED => return ended.code,
                _ => {}
            }
            let why = self.diagnosis(&ended, attempt);
            failures.push(format!(
                "attempt {} exited {}: {why}",
                attempt + 1,
                ended.code
            ));
            if attempt >= self.args.restarts {
                eprintln!(
                    "error: train launch: gave up after {attempt} restart(s): {}",
                    failures.join("; ")
                );
                return exit::FAILED;
            }
            let backoff = (self.args.backoff_s * 2f64.powi(attempt as i32)).min(MAX_BACKOFF);
            if self.sleep_unless_signalled(backoff) {
                return exit::STOPPED;
            }
            let after = self.answering();
            if !self.hosts.is_empty() && after.is_empty() {
                eprintln!(
                    "error: train launch: no host answers any more; failures: {}",
                    failures.join("; ")
                );
                return exit::FAILED;
            }
            let newest = checkpoint::newest_whole(self.run_dir()).ok();
            // No whole checkpoint yet: the run starts over, its failed attempt kept aside.
            let set_aside = match newest.is_none().then(|| self.set_aside(attempt)) {
                Some(Err(e)) => {
                    eprintln!("error: train launch: {e}");
                    return exit::FAILED;
                }
                kept => kept.and_then(Result::ok),
            };
            let state = newest
                .as_ref()
                .and_then(|n| checkpoint::read_state(&n.dir).ok());
            if let Some(state) = &state {
                match self.split_for(state.samples_per_step, after.len().max(1), split) {
                    Ok(s) => split = s,
                    Err(e) => {
                        eprintln!("error: train launch: {}", e.message());
                        return exit::REFUSED;
                    }
                }
            }
            let record = json!({
                "restart": attempt + 1,
                "at_unix_s": SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64()),
                "exit": ended.code,
                "failure": why,
                "hosts_before": hosts,
                "hosts_after": after,
                "resumed_from_step": newest.as_ref().map(|n| n.step),
                "started_over": set_aside.is_some(),
                "samples_per_step": state.as_ref().map(|s| s.samples_per_step),
                "batch_size": split.map(|s| s.batch),
                "accumulate": split.map(|s| s.accumulate),
                "backoff_s": backoff,
                "seconds_down": failed_at.elapsed().as_secs_f64(),
            });
            self.record(&record);
            eprintln!(
                "train launch: restart {} of {} after exit {} ({why}); hosts {} → {}{}",
                attempt + 1,
                self.args.restarts,
                ended.code,
                describe_hosts(&hosts),
                describe_hosts(&after),
                from_where(newest.as_ref().map(|n| n.step), set_aside.as_deref()),
            );
            hosts = after;
            attempt += 1;
        }
    }

    /// Holds the run directory from here to the job's end, across every attempt; the trainers
    /// it starts come in with the lock's token.
    fn hold(&self) -> Result<RunLock> {
        let dir = self.run_dir();
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let lock = RunLock::acquire(dir, "train launch")?;
        if let Some((holder, why)) = &lock.took_over {
            eprintln!(
                "train launch: took {} over from {}: {why}",
                dir.display(),
                holder.describe()
            );
        }
        // SAFETY: the launcher sets it before it starts a thread that reads the environment.
        unsafe { std::env::set_var(HELD_VAR, lock.token()) };
        Ok(lock)
    }

    fn answering(&self) -> Vec<String> {
        if self.hosts.is_empty() {
            Vec::new()
        } else {
            answering(&self.hosts, &self.agent)
        }
    }

    /// The split of a restart on `devices_of(processes)` devices keeping `samples` per step;
    /// `None` where the devices did not change (the run's own settings stay).
    fn split_for(
        &self,
        samples: usize,
        processes: usize,
        now: Option<Split>,
    ) -> Result<Option<Split>> {
        let (devices_per_process, configured) = self.run_settings()?;
        let devices = processes * devices_per_process;
        let now = now.unwrap_or(configured);
        if devices * now.batch * now.accumulate == samples {
            return Ok(Some(now).filter(|s| *s != configured));
        }
        keep_samples(samples, devices, now).map(Some)
    }

    /// The run's devices per process and its batch and accumulation, from its `config.toml`.
    fn run_settings(&self) -> Result<(usize, Split)> {
        let path = self.run_dir().join("config.toml");
        let config = crate::config::RootConfig::load(Some(&path), &[]).or_else(|_| {
            // A program's own sections are not kiln's: read kiln's from the table alone.
            let (mut table, origin) = crate::config::read_table(Some(&path), &[])?;
            table.retain(|k, _| k != "model" && k != "data");
            crate::config::RootConfig::from_table(table, &origin)
        })?;
        if config.strategy.name == crate::config::StrategyKind::Pipeline {
            return Err(Error::config(
                "a pipeline's stages need their devices: train launch keeps a pipeline on the \
                 devices it started with"
                    .to_string(),
            ));
        }
        Ok((
            config.hardware.devices.indices().len(),
            Split {
                batch: config.train.batch_size,
                accumulate: config.train.accumulate,
            },
        ))
    }

    /// Starts attempt `attempt` (0 the first) on `hosts` (none: here) and waits for it,
    /// forwarding a stop signal to it.
    fn attempt(
        &self,
        attempt: usize,
        hosts: &[String],
        resume: bool,
        split: Option<Split>,
    ) -> Result<Ended> {
        let dir = self.run_dir().display().to_string();
        let mut train: Vec<String> = self.args.train.clone();
        if resume {
            train.extend(["--resume".to_string(), dir]);
        } else {
            train.extend(["--run-dir".to_string(), dir]);
        }
        if let Some(s) = split {
            train.extend([
                "--batch-size".to_string(),
                s.batch.to_string(),
                "--accumulate".to_string(),
                s.accumulate.to_string(),
            ]);
        }
        let mut command = if hosts.is_empty() {
            let mut c = Command::new(&self.exe);
            c.args(&train);
            c
        } else {
            let mut words = self.args.mpirun.split_whitespace();
            let mut c = Command::new(words.next().unwrap_or("mpirun"));
            c.args(words);
            let slots: Vec<String> = hosts.iter().map(|h| format!("{h}:1")).collect();
            c.args(["--host", &slots.join(","), "-np", &hosts.len().to_string()]);
            if let Some(agent) = &self.args.rsh_agent {
                c.args(["--mca", "plm_rsh_agent", agent]);
            }
            for var in [ATTEMPT_VAR, FAULT_VAR, FAULT_ATTEMPTS_VAR, HELD_VAR] {
                c.args(["-x", var]);
            }
            c.arg(&self.exe).args(&train);
            c
        };
        command.env(ATTEMPT_VAR, attempt.to_string());
        for var in [FAULT_VAR, FAULT_ATTEMPTS_VAR] {
            // mpirun's -x needs every variable it names to exist.
            if std::env::var_os(var).is_none() {
                command.env(var, "");
            }
        }
        let mut child = command
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::config(format!("cannot start {command:?}: {e}")))?;
        let errors = pass_through(&mut child);
        let mut signalled = false;
        let mut health = Health::new(hosts);
        let mut lost: Option<(String, Instant)> = None;
        let status = loop {
            if let Some(status) = child.try_wait().map_err(|e| Error::Worker(e.to_string()))? {
                break status;
            }
            if !signalled && crate::signal::requested().is_some() {
                // Stop the run as a scheduler would: it checkpoints and exits 3.
                send(&child, libc::SIGTERM);
                signalled = true;
            }
            match &lost {
                None => {
                    if let Some(gone) = health.check(&self.agent) {
                        // A machine of the job is gone: mpirun may wait for its daemon there
                        // until TCP gives up. The job is over; end it.
                        eprintln!("train launch: {gone} stopped answering; ending the job");
                        send(&child, libc::SIGTERM);
                        lost = Some((gone, Instant::now()));
                    }
                }
                Some((_, since)) if since.elapsed() > END_WITHIN => send(&child, libc::SIGKILL),
                Some(_) => {}
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        use std::os::unix::process::ExitStatusExt;
        let code = status
            .code()
            .or_else(|| status.signal().map(|s| 128 + s))
            .unwrap_or(exit::FAILED);
        let error = match &lost {
            Some((gone, _)) => Some(format!("host {gone} stopped answering while the job ran")),
            None => errors.join().ok().flatten(),
        };
        let code = if lost.is_some() && code == exit::DONE {
            exit::FAILED
        } else {
            code
        };
        Ok(Ended {
            code,
            error,
            signalled,
        })
    }

    /// The failure's one line: the flight records' diagnosis when the ranks wrote them (what
    /// they were written for, and which rank is behind), else the run's last error line, else
    /// its exit. The records move to `restarts/attempt-N/flight/` (`train flight` reads them
    /// there), so that the next failure's are its own.
    fn diagnosis(&self, ended: &Ended, attempt: usize) -> String {
        let error = ended.error.clone().unwrap_or_else(|| match ended.code {
            c if c > 128 => format!("ended by {}", crate::signal::name(c - 128)),
            c => format!("exit code {c} without an error line"),
        });
        let flight = self.run_dir().join("flight");
        if !flight.is_dir() {
            return error;
        }
        let kept = self
            .run_dir()
            .join("restarts")
            .join(format!("attempt-{}", attempt + 1));
        let moved = std::fs::create_dir_all(&kept)
            .and_then(|()| std::fs::rename(&flight, kept.join("flight")));
        let at = if moved.is_ok() {
            kept
        } else {
            self.run_dir().to_path_buf()
        };
        match crate::flight::report(&at) {
            Ok(lines) => {
                // A host that stopped answering is the cause; the records say who was behind.
                let reason = match &ended.error {
                    Some(e) if e.contains("stopped answering") => e.clone(),
                    _ => lines
                        .first()
                        .and_then(|l| l.split_once("written for: "))
                        .map_or(error.clone(), |(_, r)| r.to_string()),
                };
                match lines.iter().rev().find(|l| l.starts_with("behind:")) {
                    Some(behind) => format!("{reason}; {behind}"),
                    None => reason,
                }
            }
            Err(_) => error,
        }
    }

    /// Moves what failed attempt `attempt` (0 the first) wrote into the run directory — its
    /// config, logs, metrics, unfinished checkpoints — to `restarts/attempt-N/run/`, so that
    /// the next attempt starts the run over in the same directory; `restarts.jsonl` and the
    /// earlier attempts' records and the job's lock stay. Returns where they went.
    fn set_aside(&self, attempt: usize) -> Result<PathBuf> {
        let run_dir = self.run_dir();
        let kept = run_dir
            .join("restarts")
            .join(format!("attempt-{}", attempt + 1))
            .join("run");
        std::fs::create_dir_all(&kept).map_err(|e| Error::io(&kept, e))?;
        for entry in std::fs::read_dir(run_dir).map_err(|e| Error::io(run_dir, e))? {
            let path = entry.map_err(|e| Error::io(run_dir, e))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name == RESTARTS_FILE
                || name == "restarts"
                || name.trim_start_matches('.').starts_with(LOCK_FILE)
            {
                continue;
            }
            std::fs::rename(&path, kept.join(name)).map_err(|e| Error::io(&path, e))?;
        }
        Ok(kept)
    }

    fn record(&self, line: &serde_json::Value) {
        let path = self.run_dir().join(RESTARTS_FILE);
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            eprintln!(
                "warning: train launch: cannot write {}: {e}",
                path.display()
            );
        }
    }

    /// `summary.json` of a finished run counts its restarts.
    fn count_restarts(&self, restarts: usize) {
        let path = self.run_dir().join("summary.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return;
        };
        if let Ok(serde_json::Value::Object(mut summary)) = serde_json::from_str(&text) {
            summary.insert("restarts".into(), json!(restarts));
            let bytes = serde_json::to_vec_pretty(&summary).expect("a summary serialises");
            if let Err(e) = write_atomic(&path, &bytes) {
                eprintln!("warning: train launch: {e}");
            }
        }
    }

    /// Sleeps `seconds`; returns early, with `true`, when a stop signal arrives.
    fn sleep_unless_signalled(&self, seconds: f64) -> bool {
        let until = Instant::now() + Duration::from_secs_f64(seconds.max(0.0));
        while Instant::now() < until {
            if crate::signal::requested().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        crate::signal::requested().is_some()
    }
}

/// How often the hosts of a running job are asked whether they answer, how many misses in a
/// row mean a host is gone, and how long a job that lost one has to end before it is killed.
const HEALTH_EVERY: Duration = Duration::from_secs(5);
const MISSES: usize = 2;
const END_WITHIN: Duration = Duration::from_secs(5);

/// The hosts of a running job, asked every [`HEALTH_EVERY`] whether they still answer.
struct Health<'h> {
    hosts: &'h [String],
    last: Instant,
    misses: Vec<usize>,
}

impl<'h> Health<'h> {
    fn new(hosts: &'h [String]) -> Self {
        Self {
            hosts,
            last: Instant::now(),
            misses: vec![0; hosts.len()],
        }
    }

    /// The first host that missed [`MISSES`] checks in a row, once one has.
    fn check(&mut self, agent: &str) -> Option<String> {
        if self.hosts.is_empty() || self.last.elapsed() < HEALTH_EVERY {
            return None;
        }
        self.last = Instant::now();
        let up = answering(self.hosts, agent);
        for (i, host) in self.hosts.iter().enumerate() {
            self.misses[i] = if up.contains(host) {
                0
            } else {
                self.misses[i] + 1
            };
            if self.misses[i] >= MISSES {
                return Some(host.clone());
            }
        }
        None
    }
}

/// Sends `signal` to the child.
fn send(child: &Child, signal: libc::c_int) {
    // SAFETY: kill(2) on the child's own pid.
    unsafe { libc::kill(child.id() as libc::pid_t, signal) };
}

/// Copies the child's standard error to the launcher's, keeping its last `error:` line.
fn pass_through(child: &mut Child) -> std::thread::JoinHandle<Option<String>> {
    let stderr = child.stderr.take();
    std::thread::spawn(move || {
        let mut last = None;
        for line in BufReader::new(stderr?)
            .lines()
            .map_while(std::result::Result::ok)
        {
            eprintln!("{line}");
            if let Some(e) = line.strip_prefix("error: ") {
                last = Some(e.to_string());
            }
        }
        last
    })
}

/// Where a restart starts: `, from step N`, or from the start with where the failed
/// attempt's files went.
fn from_where(step: Option<usize>, set_aside: Option<&Path>) -> String {
    match (step, set_aside) {
        (Some(step), _) => format!(", from step {step}"),
        (None, Some(d)) => format!(
            ", from the start: no checkpoint yet (the failed attempt's files are in {})",
            d.display()
        ),
        (None, None) => String::new(),
    }
}

fn describe_hosts(hosts: &[String]) -> String {
    if hosts.is_empty() {
        "(this machine)".to_string()
    } else {
        format!("[{}]", hosts.join(", "))
    }
}
