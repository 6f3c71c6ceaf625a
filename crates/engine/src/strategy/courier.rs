//! The communication thread of `dist.overlap`: while a rank walks its model's blocks, the
//! collectives of the walk (all-reduces, reduce-scatters, all-gathers) run on one thread
//! beside it, in exactly the order the rank hands them over, and the rank collects each
//! result when it needs it. Every rank of a group hands over the same collectives in the same
//! order, so the thread's collectives pair up across ranks as the rank's own would, and a
//! collective computes the same values on whichever thread it runs: overlap changes when a
//! reduction runs, never what it gives.
//!
//! Only the thread talks to the group during the walk (a group's collectives are ordered per
//! rank), so a walk with collectives of its own — synchronised BatchNorm — does not overlap.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::time::Instant;

use super::host::{reduce_host, scatter_host};
use super::kit::RankKit;
use crate::comm::{Collective, ReduceOp};
use crate::config::ReduceDtype;
use crate::error::{Error, Result};

/// A collective for the thread; each returns host values.
pub(crate) enum Job {
    /// The mean over ranks of a unit's gradients, bucket by bucket in the reduce dtype.
    Mean(Vec<f32>),
    /// The rank's piece of the mean over ranks of a unit's gradients.
    Scatter(Vec<f32>),
    /// Every rank's piece of a unit's parameters, in rank order.
    Gather(Vec<f32>),
}

/// A job handed over, to collect its result by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket(usize);

/// The rank's end of the communication thread.
pub(crate) struct Courier {
    jobs: Option<Sender<Job>>,
    results: Receiver<Result<Vec<f32>>>,
    /// Jobs handed over, and results received (in order: the thread runs jobs in order).
    issued: usize,
    received: usize,
    /// Results received before the rank asked for them.
    early: BTreeMap<usize, Result<Vec<f32>>>,
    /// The error the thread stopped on: no result after it comes.
    failure: Option<Error>,
    /// Seconds the rank waited for the thread.
    waited: f64,
}

impl Courier {
    fn new(jobs: Sender<Job>, results: Receiver<Result<Vec<f32>>>) -> Self {
        Self {
            jobs: Some(jobs),
            results,
            issued: 0,
            received: 0,
            early: BTreeMap::new(),
            failure: None,
            waited: 0.0,
        }
    }

    /// Hands `job` to the thread. The caller bounds what it leaves in flight (each job holds
    /// a unit's values on the host).
    pub fn send(&mut self, job: Job) -> Ticket {
        let ticket = Ticket(self.issued);
        self.issued += 1;
        if let Some(jobs) = &self.jobs {
            // A closed channel means the thread stopped on an error: the next receive says so.
            let _ = jobs.send(job);
        }
        ticket
    }

    /// The result of `ticket`, waiting for it.
    pub fn wait(&mut self, ticket: Ticket) -> Result<Vec<f32>> {
        while self.received <= ticket.0 {
            if let Some(e) = &self.failure {
                return Err(e.clone());
            }
            self.receive()?;
        }
        self.early
            .remove(&ticket.0)
            .expect("each ticket's result is taken once")
    }

    /// Whether `ticket`'s result has come back (without waiting).
    pub fn ready(&mut self, ticket: Ticket) -> Result<bool> {
        while self.received <= ticket.0 {
            if self.failure.is_some() {
                // The rank's wait reports it.
                return Ok(true);
            }
            match self.results.try_recv() {
                Ok(result) => self.keep(result),
                Err(TryRecvError::Empty) => return Ok(false),
                Err(TryRecvError::Disconnected) => return Err(stopped()),
            }
        }
        Ok(true)
    }

    /// Receives the next result into `early`, counting the wait.
    fn receive(&mut self) -> Result<()> {
        let started = Instant::now();
        let result = self.results.recv().map_err(|_| stopped());
        self.waited += started.elapsed().as_secs_f64();
        self.keep(result?);
        Ok(())
    }

    /// Keeps the next result until the rank asks for it.
    fn keep(&mut self, result: Result<Vec<f32>>) {
        if let Err(e) = &result {
            self.failure.get_or_insert_with(|| e.clone());
        }
        self.early.insert(self.received, result);
        self.received += 1;
    }
}

fn stopped() -> Error {
    Error::Worker("the communication thread stopped".into())
}

/// Runs `walk` with a communication thread for `kit`'s group beside it. The time the rank waits for results, and for the thread to finish after
/// `walk`, counts as synchronisation. After an error in `walk`, the thread finishes the jobs
/// it was given (every other rank hands over the same ones) and stops.
pub(crate) fn beside<T>(
    kit: &mut RankKit,
    walk: impl FnOnce(&mut RankKit, &mut Courier) -> Result<T>,
) -> Result<T> {
    let group = kit.comm.clone();
    let (dtype, bucket) = (kit.policy.reduce_dtype(), kit.bucket_elements);
    std::thread::scope(|scope| {
        let (jobs, inbox) = channel::<Job>();
        let (outbox, results) = channel();
        let group: &dyn Collective = &*group;
        let thread = scope.spawn(move || {
            raise_priority();
            for job in inbox {
                let result = run(group, job, dtype, bucket);
                let failed = result.is_err();
                if outbox.send(result).is_err() || failed {
                    break;
                }
            }
        });
        let mut courier = Courier::new(jobs, results);
        let out = walk(&mut *kit, &mut courier);
        courier.jobs = None;
        let started = Instant::now();
        let joined = thread
            .join()
            .map_err(|_| Error::Worker("the communication thread panicked".into()));
        kit.add_sync_seconds(courier.waited + started.elapsed().as_secs_f64());
        let out = out?;
        joined?;
        debug_assert_eq!(
            courier.issued, courier.received,
            "every job's result collected"
        );
        Ok(out)
    })
}

/// How many steps of nice a communication thread asks to stand above the thread that starts
/// it (the rank's compute).
const NICE: i32 = -10;

/// Raises this thread's scheduling priority [`NICE`] steps above its own (a new thread's is
/// the process's) where the process may (root, `CAP_SYS_NICE`, or an `RLIMIT_NICE` that allows
/// the value: `ulimit -e` of 30 or more for nice −10 from 0); elsewhere it stays at the
/// compute's, and no later thread asks again. The thread sleeps while its collective waits on
/// the network (`comm::mpi`'s non-blocking collectives), so the priority costs the compute
/// only the work the thread does; what it buys is that the thread gets a kit as soon as it
/// wakes, where the ranks' compute fills the cores (two processes on 2 cores at 1 Gbit/s: the
/// GPT's ddp step 64–66 ms at the compute's priority, 59–60 ms raised; BENCHMARKS.md).
fn raise_priority() {
    #[cfg(target_os = "linux")]
    {
        use std::sync::atomic::{AtomicBool, Ordering};
        static REFUSED: AtomicBool = AtomicBool::new(false);
        if REFUSED.load(Ordering::Relaxed) || !set_nice(NICE) {
            REFUSED.store(true, Ordering::Relaxed);
        }
    }
}

/// Moves this thread's nice value by `by` (within Linux's −20..19); whether it was allowed.
#[cfg(target_os = "linux")]
fn set_nice(by: i32) -> bool {
    // SAFETY: gettid has no preconditions; getpriority and setpriority on this thread's own id
    // read and change only its scheduling.
    unsafe {
        let me = libc::gettid() as libc::id_t;
        let now = libc::getpriority(libc::PRIO_PROCESS, me);
        libc::setpriority(libc::PRIO_PROCESS, me, (now + by).clamp(-20, 19)) == 0
    }
}

/// One job on `group`.
fn run(group: &dyn Collective, job: Job, dtype: ReduceDtype, bucket: usize) -> Result<Vec<f32>> {
    match job {
        Job::Mean(host) => reduce_host(group, host, ReduceOp::Mean, dtype, bucket),
        Job::Scatter(host) => scatter_host(group, &host, dtype),
        Job::Gather(mine) => group.all_gather(&mine),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread that answers jobs as `answers` says, in order, and stops after an error.
    fn courier(answers: Vec<Result<Vec<f32>>>) -> (Courier, std::thread::JoinHandle<()>) {
        let (jobs, inbox) = channel::<Job>();
        let (outbox, results) = channel();
        let thread = std::thread::spawn(move || {
            for (_, answer) in inbox.into_iter().zip(answers) {
                let failed = answer.is_err();
                if outbox.send(answer).is_err() || failed {
                    break;
                }
            }
        });
        (Courier::new(jobs, results), thread)
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_communication_thread_runs_above_the_compute_where_the_process_may_raise_it() {
        // SAFETY: gettid and getpriority on this thread's own id.
        let nice =
            || unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
        let (before, after, allowed) = std::thread::spawn(move || {
            let before = nice();
            // Whether this process may raise a thread's priority that far: tried on a
            // throwaway thread of its own.
            let allowed = std::thread::spawn(move || set_nice(NICE)).join().unwrap();
            raise_priority();
            (before, nice(), allowed)
        })
        .join()
        .unwrap();
        let raised = (before + NICE).clamp(-20, 19);
        assert_eq!(
            after,
            if allowed { raised } else { before },
            "allowed: {allowed}"
        );
    }

    #[test]
    fn results_come_back_by_ticket_in_any_order_of_asking() {
        let (mut c, thread) = courier(vec![Ok(vec![1.0]), Ok(vec![2.0]), Ok(vec![3.0])]);
        let t: Vec<Ticket> = (0..3).map(|_| c.send(Job::Gather(vec![]))).collect();
        assert_eq!(c.wait(t[2]).unwrap(), [3.0]);
        assert!(c.ready(t[0]).unwrap());
        assert_eq!(c.wait(t[0]).unwrap(), [1.0]);
        assert_eq!(c.wait(t[1]).unwrap(), [2.0]);
        drop(c);
        thread.join().unwrap();
    }

    #[test]
    fn a_wait_past_the_job_that_failed_reports_its_error() {
        // The thread stops after job 1's error: waiting for job 2 must say why, not only that
        // the thread is gone.
        let (mut c, thread) = courier(vec![
            Ok(vec![1.0]),
            Err(Error::Worker("stopped because rank 1 failed".into())),
            Ok(vec![3.0]),
        ]);
        let t: Vec<Ticket> = (0..3).map(|_| c.send(Job::Gather(vec![]))).collect();
        let e = c.wait(t[2]).unwrap_err().to_string();
        assert!(e.contains("rank 1 failed"), "{e}");
        assert_eq!(c.wait(t[0]).unwrap(), [1.0]);
        assert!(c.ready(t[2]).unwrap(), "a failure is an answer");
        drop(c);
        thread.join().unwrap();
    }
}
