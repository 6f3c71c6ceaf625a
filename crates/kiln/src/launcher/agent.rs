//! The launcher's loop: start the run, wait for it with an ear for signals, decide from its
//! exit code, and start it again on the hosts that answer.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;

use super::args::LaunchArgs;
use super::child::{END_WITHIN, Streaks, pass_through, send};
use super::hosts::{answering, configured};
use super::readmit::{Readmission, leave_out_flapping, missing, with_back};
use super::record::{count_restarts, record, set_aside};
use super::split::{Split, keep_samples};
use kiln_engine::checkpoint;
use kiln_engine::error::{Error, Result, exit};
use kiln_engine::runlock::{HELD_VAR, RunLock};
use kiln_engine::trainer::{ATTEMPT_VAR, FAULT_ATTEMPTS_VAR, FAULT_VAR};

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
    /// The hosts that answered again while it ran, for which the launcher stopped it (a
    /// planned restart on the larger world).
    readmit: Option<Vec<String>>,
    /// The host whose loss ended it, if one did.
    lost: Option<String>,
}

/// What a restart's lines say.
struct Restart<'r> {
    /// The attempt that ended (0 the first).
    attempt: usize,
    ended: &'r Ended,
    /// The failure's diagnosis, or the hosts that answer again.
    why: &'r str,
    before: &'r [String],
    after: &'r [String],
    /// The step it resumes from (none: from the start).
    newest: Option<usize>,
    /// Where the failed attempt's files went, when the run starts over.
    set_aside: Option<&'r Path>,
    samples: Option<usize>,
    split: Option<Split>,
    backoff: f64,
    /// Seconds from the end of the attempt to the restart.
    down: f64,
    /// Failures so far.
    failures: usize,
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
        kiln_engine::signal::install();
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
        let mut readmission = Readmission::new(Duration::from_secs_f64(self.args.readmit_after_s));
        loop {
            let resume = checkpoint::newest_whole(self.run_dir()).is_ok();
            let left_out = readmission.left_out();
            let ended = match self.attempt(attempt, &hosts, resume, split, left_out) {
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
                    count_restarts(self.run_dir(), attempt);
                    return exit::DONE;
                }
                // A planned stop to take hosts back ends as a signal's stop does.
                _ if ended.readmit.is_some() => {}
                exit::REFUSED | exit::DIVERGED | exit::STOPPED => return ended.code,
                _ => {}
            }
            let (why, after, backoff) = match &ended.readmit {
                Some(back) => {
                    readmission.taken_back(back);
                    let why = format!("{} answer again", back.join(", "));
                    (why, with_back(&self.hosts, &hosts, back), 0.0)
                }
                None => match self.after_failure(&ended, attempt, &mut failures) {
                    Ok((why, after, backoff)) => {
                        let lost: Vec<&String> = hosts
                            .iter()
                            .filter(|h| !after.contains(h) || ended.lost.as_ref() == Some(h))
                            .collect();
                        let after = leave_out_flapping(&lost, after, &mut readmission);
                        (why, after, backoff)
                    }
                    Err(code) => return code,
                },
            };
            let newest = checkpoint::newest_whole(self.run_dir()).ok();
            // No whole checkpoint yet: the run starts over, its failed attempt kept aside.
            let set_aside = match newest.is_none().then(|| set_aside(self.run_dir(), attempt)) {
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
            self.announce(Restart {
                attempt,
                ended: &ended,
                why: &why,
                before: &hosts,
                after: &after,
                newest: newest.as_ref().map(|n| n.step),
                set_aside: set_aside.as_deref(),
                samples: state.as_ref().map(|s| s.samples_per_step),
                split,
                backoff,
                down: failed_at.elapsed().as_secs_f64(),
                failures: failures.len(),
            });
            hosts = after;
            attempt += 1;
        }
    }

    /// A restart's line of `restarts.jsonl` and its line on standard error.
    fn announce(&self, r: Restart<'_>) {
        let line = json!({
            "restart": r.attempt + 1,
            "at_unix_s": SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            "exit": r.ended.code,
            "failure": r.ended.readmit.is_none().then_some(r.why),
            "readmitted": r.ended.readmit,
            "hosts_before": r.before,
            "hosts_after": r.after,
            "resumed_from_step": r.newest,
            "started_over": r.set_aside.is_some(),
            "samples_per_step": r.samples,
            "batch_size": r.split.map(|s| s.batch),
            "accumulate": r.split.map(|s| s.accumulate),
            "backoff_s": r.backoff,
            "seconds_down": r.down,
        });
        record(self.run_dir(), &line);
        let what = match &r.ended.readmit {
            Some(_) => format!("a planned restart: {}", r.why),
            None => format!(
                "restart {} of {} after exit {} ({})",
                r.failures, self.args.restarts, r.ended.code, r.why
            ),
        };
        eprintln!(
            "train launch: {what}; hosts {} → {}{}",
            describe_hosts(r.before),
            describe_hosts(r.after),
            from_where(r.newest, r.set_aside),
        );
    }

    /// After attempt `attempt` failed: its diagnosis, the hosts that answer after the
    /// back-off, and the back-off; `Err` with the launcher's exit code where it ends (the
    /// restarts ran out, a signal, no host answers).
    fn after_failure(
        &self,
        ended: &Ended,
        attempt: usize,
        failures: &mut Vec<String>,
    ) -> std::result::Result<(String, Vec<String>, f64), i32> {
        let why = self.diagnosis(ended, attempt);
        failures.push(format!(
            "attempt {} exited {}: {why}",
            attempt + 1,
            ended.code
        ));
        if failures.len() > self.args.restarts {
            eprintln!(
                "error: train launch: gave up after {} restart(s) after failures: {}",
                failures.len() - 1,
                failures.join("; ")
            );
            return Err(exit::FAILED);
        }
        let n = failures.len() - 1;
        let backoff = (self.args.backoff_s * 2f64.powi(n as i32)).min(MAX_BACKOFF);
        if self.sleep_unless_signalled(backoff) {
            return Err(exit::STOPPED);
        }
        let after = self.answering();
        if !self.hosts.is_empty() && after.is_empty() {
            eprintln!(
                "error: train launch: no host answers any more; failures: {}",
                failures.join("; ")
            );
            return Err(exit::FAILED);
        }
        Ok((why, after, backoff))
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

    /// The run's kiln settings, from its `config.toml`.
    fn run_config(&self) -> Result<kiln_engine::config::RootConfig> {
        let path = self.run_dir().join("config.toml");
        kiln_engine::config::RootConfig::load(Some(&path), &[]).or_else(|_| {
            // A program's own sections are not kiln's: read kiln's from the table alone.
            let (mut table, origin) = kiln_engine::config::read_table(Some(&path), &[])?;
            table.retain(|k, _| k != "model" && k != "data");
            kiln_engine::config::RootConfig::from_table(table, &origin)
        })
    }

    /// The step of the newest checkpoint listed in the run (0 with none; not verified).
    fn newest_listed(&self) -> usize {
        checkpoint::list(self.run_dir()).last().map_or(0, |c| c.0)
    }

    /// Whether the run writes a checkpoint when a signal stops it
    /// (`train.checkpoint_on_signal`, from its `config.toml`).
    fn stops_with_checkpoint(&self) -> bool {
        self.run_config()
            .map_or(true, |c| c.train.checkpoint_on_signal)
    }

    /// The run's devices per process and its batch and accumulation, from its `config.toml`.
    fn run_settings(&self) -> Result<(usize, Split)> {
        let config = self.run_config()?;
        if let Some(why) = kiln_engine::strategy::rules(config.strategy.name).fixed_devices() {
            return Err(Error::config(why.to_string()));
        }
        Ok((
            config.hardware.devices.indices().len(),
            Split {
                batch: config.train.batch_size,
                accumulate: config.train.accumulate,
            },
        ))
    }

    /// The command of attempt `attempt` on `hosts` (none: one process here): `train` with its
    /// arguments, `--resume` or `--run-dir`, the split where it changed, under `mpirun`.
    fn command(
        &self,
        attempt: usize,
        hosts: &[String],
        resume: bool,
        split: Option<Split>,
    ) -> Command {
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
        command
    }

    /// Starts attempt `attempt` (0 the first) on `hosts` (none: here) and waits for it,
    /// forwarding a stop signal to it.
    fn attempt(
        &self,
        attempt: usize,
        hosts: &[String],
        resume: bool,
        split: Option<Split>,
        left_out: &[String],
    ) -> Result<Ended> {
        let mut command = self.command(attempt, hosts, resume, split);
        let mut child = command
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::config(format!("cannot start {command:?}: {e}")))?;
        let errors = pass_through(&mut child);
        let mut signalled = false;
        let mut health = Streaks::misses(hosts);
        let mut lost: Option<(String, Instant)> = None;
        let mut returns = Streaks::answers(missing(&self.hosts, hosts, left_out));
        let (mut back, mut readmit) = (None, None);
        let status = loop {
            if let Some(status) = child.try_wait().map_err(|e| Error::Worker(e.to_string()))? {
                break status;
            }
            if !signalled && kiln_engine::signal::requested().is_some() {
                // Stop the run as a scheduler would: it checkpoints and exits 3.
                send(&child, libc::SIGTERM);
                signalled = true;
            }
            match &lost {
                None => {
                    if let Some(gone) = health.check(&self.agent).into_iter().next() {
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
            // A missing host that answers again is taken back at the job's next checkpoint: the
            // stop's own (SIGTERM), or with `train.checkpoint_on_signal = false` the next
            // periodic one.
            if lost.is_none() && !signalled && readmit.is_none() {
                if back.is_none() {
                    let answered = returns.check(&self.agent);
                    // The run's setting is read once, when a host is back.
                    back = (!answered.is_empty())
                        .then(|| (answered, self.newest_listed(), self.stops_with_checkpoint()));
                }
                if let Some((hosts_back, at, on_signal)) = &back
                    && (*on_signal || self.newest_listed() > *at)
                {
                    eprintln!(
                        "train launch: {} answer{} again; stopping the job at a checkpoint to \
                         take {} back",
                        hosts_back.join(", "),
                        if hosts_back.len() == 1 { "s" } else { "" },
                        if hosts_back.len() == 1 { "it" } else { "them" },
                    );
                    send(&child, libc::SIGTERM);
                    readmit = back.take().map(|(b, _, _)| b);
                }
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
            readmit,
            lost: lost.map(|(host, _)| host),
        })
    }

    /// The failure's one line: the flight records' diagnosis when the ranks wrote them (what
    /// they were written for, and which rank is behind), else the run's last error line, else
    /// its exit. The records move to `restarts/attempt-N/flight/` (`train flight` reads them
    /// there), so that the next failure's are its own.
    fn diagnosis(&self, ended: &Ended, attempt: usize) -> String {
        let error = ended.error.clone().unwrap_or_else(|| match ended.code {
            c if c > 128 => format!("ended by {}", kiln_engine::signal::name(c - 128)),
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
        match kiln_engine::flight::report(&at) {
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

    /// Sleeps `seconds`; returns early, with `true`, when a stop signal arrives.
    fn sleep_unless_signalled(&self, seconds: f64) -> bool {
        let until = Instant::now() + Duration::from_secs_f64(seconds.max(0.0));
        while Instant::now() < until {
            if kiln_engine::signal::requested().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        kiln_engine::signal::requested().is_some()
    }
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
