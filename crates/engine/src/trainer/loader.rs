//! The loop's training batches: built on the rank's own thread when a step needs them
//! (`data.workers = 0`), or by loader threads that build the coming batches `data.prefetch`
//! steps ahead.
//!
//! Every batch is a *job*, numbered in the order the rank takes them: step after step, each
//! parameter group's micro-batches in turn. [`Jobs`] maps a job to its samples — a function of
//! (seed, epoch, step, rank), whoever builds it — so that any number of workers gives the same
//! bits, and a resumed run's loader starts from the checkpoint's position. Loader threads
//! claim jobs in order and put what they built (or the error that stopped them) into a
//! bounded queue; the rank takes its jobs in order and waits only for the one it needs.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use burn::prelude::*;

use super::faults::{FAULT_VAR, loader_fault};
use super::workload::Workload;
use crate::data::{DistributedSampler, building};
use crate::error::{Error, Result};
use crate::state::LoopState;

/// Which samples every job of one rank's run takes.
#[derive(Debug, Clone)]
pub(crate) struct Jobs {
    pub sampler: DistributedSampler,
    /// The loop's position when the loader started (job 0 is its next step's first batch).
    pub step: usize,
    pub epoch: usize,
    pub step_in_epoch: usize,
    /// Micro-batches per optimizer step, and optimizer phases (parameter groups) per step.
    pub micros: usize,
    pub phases: usize,
    pub data_rank: usize,
    pub data_world: usize,
    pub batch_size: usize,
    pub seed: u64,
    /// The run's last step: nothing is built beyond it.
    pub total: usize,
}

/// Where a job sits in the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct At {
    step: usize,
    epoch: usize,
    step_in_epoch: usize,
    micro: usize,
}

impl Jobs {
    /// The jobs of a loop that is at `state`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        sampler: DistributedSampler,
        state: &LoopState,
        micros: usize,
        phases: usize,
        data_rank: usize,
        data_world: usize,
        batch_size: usize,
        seed: u64,
        total: usize,
    ) -> Self {
        Self {
            sampler,
            step: state.step,
            epoch: state.epoch,
            step_in_epoch: state.step_in_epoch,
            micros,
            phases: phases.max(1),
            data_rank,
            data_world,
            batch_size,
            seed,
            total,
        }
    }

    /// Jobs from the start to the end of the run.
    fn count(&self) -> usize {
        self.total.saturating_sub(self.step) * self.jobs_per_step()
    }

    /// Jobs per optimizer step.
    pub fn jobs_per_step(&self) -> usize {
        self.micros * self.phases
    }

    /// The job number of micro-batch `micro` of phase `phase` at optimizer step `step`.
    pub fn job(&self, step: usize, phase: usize, micro: usize) -> usize {
        (step - self.step) * self.jobs_per_step() + phase * self.micros + micro
    }

    /// Where job `job` sits: its step, epoch and position in the epoch. The loop moves to the
    /// next epoch when a step begins at the end of one, as [`LoopState`] does.
    fn at(&self, job: usize) -> At {
        let k = job / self.jobs_per_step();
        let micro = job % self.jobs_per_step() % self.micros;
        let per_epoch = self.sampler.steps_per_epoch();
        let s = self.step_in_epoch + k;
        At {
            step: self.step + k,
            epoch: self.epoch + s / per_epoch,
            step_in_epoch: s % per_epoch,
            micro,
        }
    }

    /// Builds job `job` on `device`: its samples, then the workload's batch of them, with
    /// [`sample_rng`](crate::data::sample_rng) keyed to this run's seed and the job's step. `order`
    /// caches the last epoch's order.
    fn build<W: Workload>(
        &self,
        workload: &W,
        job: usize,
        device: &Device,
        order: &mut Option<(usize, Vec<usize>)>,
    ) -> Result<W::Batch> {
        let at = self.at(job);
        // The step's slots, micro-batch major: the same samples per step for any split.
        let slot = at.micro * self.data_world + self.data_rank;
        let slots = self.micros * self.data_world;
        let indices = match workload.sample(at.step, slot, slots, self.batch_size) {
            Some(indices) => indices,
            None => {
                if order.as_ref().is_none_or(|(e, _)| *e != at.epoch) {
                    *order = Some((at.epoch, self.sampler.epoch_order(at.epoch)));
                }
                let (_, order) = order.as_ref().expect("set above");
                self.sampler
                    .indices(order, at.step_in_epoch, at.micro, self.data_rank)
            }
        };
        building(self.seed, at.step, || {
            workload.try_train_batch(&indices, at.step, device)
        })
    }
}

/// The jobs the loader threads share with their rank.
struct Queue<B> {
    /// The next job a loader thread claims.
    claimed: usize,
    /// The next job the rank takes.
    taken: usize,
    /// Built jobs the rank has not taken yet.
    done: BTreeMap<usize, Result<B>>,
    stop: bool,
}

struct Shared<B> {
    queue: Mutex<Queue<B>>,
    /// Signalled when a job is done (the rank waits on it).
    ready: Condvar,
    /// Signalled when the rank takes a job or stops the loader (the threads wait on it).
    room: Condvar,
    /// Jobs built or being built ahead of the rank at most.
    capacity: usize,
}

impl<B> Shared<B> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<B>> {
        // A loader thread never panics while holding the lock (the build runs outside it).
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A rank's source of training batches.
pub(crate) struct Feed<'a, W: Workload> {
    workload: &'a W,
    jobs: Arc<Jobs>,
    device: Device,
    /// The last epoch order the rank's own builds used.
    order: Option<(usize, Vec<usize>)>,
    ahead: Option<Arc<Shared<W::Batch>>>,
    /// How long the rank waits for one batch of the loader threads (`dist.timeout_s`).
    deadline: Option<Duration>,
    rank: usize,
}

impl<'a, W: Workload> Feed<'a, W> {
    /// A feed that builds every batch on the rank's thread when it is taken.
    pub fn inline(workload: &'a W, jobs: Jobs, device: Device) -> Self {
        Self {
            workload,
            jobs: Arc::new(jobs),
            device,
            order: None,
            ahead: None,
            deadline: None,
            rank: 0,
        }
    }

    /// A feed whose batches `workers` loader threads (spawned in `scope`, named after `rank`)
    /// build up to `prefetch` steps ahead, the rank waiting at most `deadline` for one; with
    /// no workers, [`Feed::inline`].
    #[allow(clippy::too_many_arguments)]
    pub fn start<'scope>(
        scope: &'scope std::thread::Scope<'scope, '_>,
        workload: &'a W,
        jobs: Jobs,
        device: Device,
        workers: usize,
        prefetch: usize,
        rank: usize,
        deadline: Option<Duration>,
    ) -> Self
    where
        'a: 'scope,
    {
        let mut feed = Self::inline(workload, jobs, device);
        feed.rank = rank;
        feed.deadline = deadline;
        if workers == 0 {
            return feed;
        }
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                claimed: 0,
                taken: 0,
                done: BTreeMap::new(),
                stop: false,
            }),
            ready: Condvar::new(),
            room: Condvar::new(),
            capacity: (prefetch * feed.jobs.jobs_per_step()).max(1),
        });
        for i in 0..workers {
            let (shared, jobs, device) = (shared.clone(), feed.jobs.clone(), feed.device.clone());
            std::thread::Builder::new()
                .name(format!("kiln-worker-{rank}-loader-{i}"))
                .spawn_scoped(scope, move || load(workload, &jobs, &device, &shared, rank))
                .expect("spawn a loader thread");
        }
        feed.ahead = Some(shared);
        feed
    }

    /// Micro-batch `micro` of phase `phase` of optimizer step `step`: built now, or taken
    /// from the loader threads (waiting for it if it is not built yet). A job the rank skips
    /// is dropped.
    pub fn take(&mut self, step: usize, phase: usize, micro: usize) -> Result<W::Batch> {
        let job = self.jobs.job(step, phase, micro);
        let Some(shared) = &self.ahead else {
            return self
                .jobs
                .build(self.workload, job, &self.device, &mut self.order);
        };
        let mut q = shared.lock();
        if q.claimed < job {
            q.claimed = job;
        }
        let since = Instant::now();
        loop {
            if let Some(batch) = q.done.remove(&job) {
                q.taken = job + 1;
                q.done.retain(|&j, _| j > job);
                shared.room.notify_all();
                return batch;
            }
            let Some(deadline) = self.deadline else {
                q = shared.ready.wait(q).unwrap_or_else(|e| e.into_inner());
                continue;
            };
            let left = deadline.saturating_sub(since.elapsed());
            if left.is_zero() {
                return Err(Error::Worker(format!(
                    "rank {} waited {:.0} s (dist.timeout_s) for the batch of step {} from its \
                     data loader threads: one is stuck building it (in the workload's batch \
                     code)",
                    self.rank,
                    deadline.as_secs_f64(),
                    step + 1
                )));
            }
            q = shared
                .ready
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl<W: Workload> Drop for Feed<'_, W> {
    fn drop(&mut self) {
        if let Some(shared) = &self.ahead {
            shared.lock().stop = true;
            shared.room.notify_all();
        }
    }
}

/// A loader thread: claims the next job while there is room ahead of the rank, builds it
/// outside the lock (a panic in the workload's code becomes the job's error), and hands it
/// over, until the rank stops the feed.
fn load<W: Workload>(
    workload: &W,
    jobs: &Jobs,
    device: &Device,
    shared: &Shared<W::Batch>,
    rank: usize,
) {
    let mut order = None;
    loop {
        let job = {
            let mut q = shared.lock();
            while !q.stop && (q.claimed >= q.taken + shared.capacity || q.claimed >= jobs.count()) {
                q = shared.room.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            if q.stop {
                return;
            }
            q.claimed += 1;
            q.claimed - 1
        };
        let built = std::panic::catch_unwind(AssertUnwindSafe(|| {
            match loader_fault(rank, jobs.at(job).step + 1) {
                Some(true) => loop {
                    std::thread::sleep(Duration::from_secs(3600));
                },
                Some(false) => {
                    panic!("injected loader failure ({})", FAULT_VAR)
                }
                None => jobs.build(workload, job, device, &mut order),
            }
        }))
        .unwrap_or_else(|payload| {
            Err(Error::Worker(format!(
                "rank {rank}'s data loader failed building step {} (a panic): {}",
                jobs.at(job).step + 1,
                crate::panics::panic_message(&payload)
            )))
        });
        let mut q = shared.lock();
        if job >= q.taken {
            q.done.insert(job, built);
            shared.ready.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_step(step: usize, epoch: usize, step_in_epoch: usize) -> LoopState {
        LoopState {
            step,
            epoch,
            step_in_epoch,
            seed: 3,
            world_size: 2,
            samples_per_step: 16,
            lr: 0.0,
            samples: 0,
            wall_seconds: 0.0,
            scaler: None,
            early: None,
            plateaus: Vec::new(),
        }
    }

    fn jobs(len: usize, state: LoopState, micros: usize, phases: usize) -> Jobs {
        let sampler = DistributedSampler::new(len, 3, 2, 4, micros, false);
        Jobs::new(sampler, &state, micros, phases, 1, 2, 4, 3, 100)
    }

    #[test]
    fn jobs_walk_steps_epochs_and_phases_as_the_loop_does() {
        // 40 samples, 2 ranks × 4 × 2 micro-batches = 16 per step: 3 steps per epoch.
        let p = jobs(40, at_step(0, 0, 0), 2, 2);
        assert_eq!(p.jobs_per_step(), 4);
        let at = |j| {
            let a = p.at(j);
            (a.step, a.epoch, a.step_in_epoch, a.micro)
        };
        assert_eq!(at(0), (0, 0, 0, 0));
        assert_eq!(at(1), (0, 0, 0, 1));
        assert_eq!(at(2), (0, 0, 0, 0)); // the second group's first micro-batch
        assert_eq!(at(4), (1, 0, 1, 0));
        assert_eq!(at(12), (3, 1, 0, 0));
        assert_eq!(p.job(3, 1, 1), 15);
        // A loop resumed at the end of an epoch starts the next one.
        let p = jobs(40, at_step(3, 0, 3), 2, 1);
        let a = p.at(0);
        assert_eq!((a.step, a.epoch, a.step_in_epoch), (3, 1, 0));
        assert_eq!(p.job(4, 0, 1), 3);
    }
}
