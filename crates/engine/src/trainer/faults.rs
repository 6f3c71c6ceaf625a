//! Faults: the test facility that injects one into a rank (`KILN_FAULT_INJECT`) — into its
//! step by a wrapper around its strategy, into its loader threads and its checkpoint writer
//! by one call each — and how a rank tells the failure that started an abort from the aborts
//! it caused.

use std::time::Duration;

use burn::prelude::*;
use kiln_models::StepOutput;

use crate::error::{Error, Result};
use crate::optim::OptimState;
use crate::precision::LossScaler;
use crate::strategy::{Memory, Report, Strategy};

pub(super) const ABORTED: &str = "stopped because ";

/// Whether `e` is a rank's report that another rank aborted the group.
pub(super) fn is_abort_echo(e: &Error) -> bool {
    matches!(e, Error::Worker(m) if m.starts_with(ABORTED))
}

/// The environment variable that injects a fault into one rank, to test how a run ends (a test
/// facility, in-process and across processes): `KILN_FAULT_INJECT=rank:step` panics after that
/// step, `rank:step:hang` stops making progress after it, `rank:step:slow=MS` adds MS
/// milliseconds of compute to every step from that one on (a straggler), and
/// `rank:step:loader-hang` / `rank:step:loader-panic` make a loader thread of the rank
/// (`data.workers` > 0) hang or panic building that step's batch, and `rank:step:slow-write=MS`
/// makes the rank's checkpoint writer wait MS milliseconds before writing each checkpoint from
/// that step on (a slow disk; the run's numbers do not change; a gathered checkpoint's writer is
/// rank 0's), and `rank:step:fail-write` makes the rank's writer of that step's sharded
/// checkpoint fail (a full disk).
pub const FAULT_VAR: &str = "KILN_FAULT_INJECT";

/// The attempt of a run the launcher (`train launch`) started: 0 for the first, then one more
/// for each restart. An injected fault happens in the first `KILN_FAULT_ATTEMPTS` attempts
/// (default 1), so that a restarted run can get past it.
pub const ATTEMPT_VAR: &str = "KILN_LAUNCH_ATTEMPT";

/// How many attempts of a launched run an injected fault happens in (default 1).
pub const FAULT_ATTEMPTS_VAR: &str = "KILN_FAULT_ATTEMPTS";

/// A fault the variable injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    Panic,
    Hang,
    Slow(Duration),
    /// A loader thread of the rank stops making progress building the step's batch.
    LoaderHang,
    /// A loader thread of the rank panics building the step's batch.
    LoaderPanic,
    /// The checkpoint writer waits this long before each write.
    SlowWrite(Duration),
    /// The rank's writer of a sharded checkpoint fails (a full disk).
    FailWrite,
}

/// How long the checkpoint writer waits before writing the checkpoint of `step`, by the
/// injected fault.
pub(super) fn write_delay(rank: usize, step: usize) -> Option<Duration> {
    match injected_fault()? {
        (r, at, Fault::SlowWrite(d)) if r == rank && step >= at => Some(d),
        _ => None,
    }
}

/// Whether `rank`'s writer of a sharded checkpoint fails at `step`, by the injected fault.
pub(super) fn write_fails(rank: usize, step: usize) -> bool {
    matches!(injected_fault(), Some((r, at, Fault::FailWrite)) if r == rank && at == step)
}

/// The fault injected into `rank`'s loader threads as they build the batches of step `step`
/// (1-based): `true` hangs, `false` panics.
pub(super) fn loader_fault(rank: usize, step: usize) -> Option<bool> {
    match injected_fault()? {
        (r, at, Fault::LoaderHang) if r == rank && at == step => Some(true),
        (r, at, Fault::LoaderPanic) if r == rank && at == step => Some(false),
        _ => None,
    }
}

/// The `(rank, step, fault)` the variable asks for, if it does.
pub(super) fn injected_fault() -> Option<(usize, usize, Fault)> {
    static FAULT: std::sync::OnceLock<Option<(usize, usize, Fault)>> = std::sync::OnceLock::new();
    *FAULT.get_or_init(|| {
        let raw = std::env::var(FAULT_VAR).ok()?;
        let number = |var: &str| std::env::var(var).ok()?.trim().parse::<usize>().ok();
        if number(ATTEMPT_VAR).unwrap_or(0) >= number(FAULT_ATTEMPTS_VAR).unwrap_or(1) {
            return None;
        }
        let mut parts = raw.split(':').map(str::trim);
        let rank = parts.next()?.parse().ok()?;
        let step = parts.next()?.parse().ok()?;
        let fault = match parts.next() {
            None => Fault::Panic,
            Some("hang") => Fault::Hang,
            Some("loader-hang") => Fault::LoaderHang,
            Some("loader-panic") => Fault::LoaderPanic,
            Some("fail-write") => Fault::FailWrite,
            Some(write) if write.starts_with("slow-write=") => {
                let ms = write.strip_prefix("slow-write=")?.parse().ok()?;
                Fault::SlowWrite(Duration::from_millis(ms))
            }
            Some(slow) => {
                let ms = slow.strip_prefix("slow=")?.parse().ok()?;
                Fault::Slow(Duration::from_millis(ms))
            }
        };
        Some((rank, step, fault))
    })
}

/// A rank's strategy with the fault the variable injects into it around it: a straggler's
/// pause after its micro-steps from the named step on (compute time, as a slow device's), a
/// panic or a hang once the named step is taken. Built only when the variable names the rank
/// and one of these faults ([`with_injected_fault`]), so that a run without it has nothing of
/// the facility in its step.
struct Faulty<'a, M, B> {
    inner: Box<dyn Strategy<M, B> + 'a>,
    fault: Fault,
    /// The step the variable names (1-based).
    at: usize,
    /// Steps taken so far, and the optimizer steps of the one in progress (one per group).
    done: usize,
    phase: usize,
    groups: usize,
}

/// `strategy`, wrapped in the fault the variable injects into `rank` (whose run starts after
/// `done` steps and takes one optimizer step per each of `groups` groups), if it injects one
/// into the step.
pub(super) fn with_injected_fault<'a, M: 'a, B: 'a>(
    strategy: Box<dyn Strategy<M, B> + 'a>,
    rank: usize,
    done: usize,
    groups: usize,
) -> Box<dyn Strategy<M, B> + 'a> {
    match injected_fault() {
        Some((r, at, fault @ (Fault::Panic | Fault::Hang | Fault::Slow(_)))) if r == rank => {
            Box::new(Faulty {
                inner: strategy,
                fault,
                at,
                done,
                phase: 0,
                groups: groups.max(1),
            })
        }
        _ => strategy,
    }
}

impl<M, B> Strategy<M, B> for Faulty<'_, M, B> {
    fn begin_step(&mut self) -> Result<()> {
        self.inner.begin_step()
    }

    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        let outs = self.inner.micro_steps(batches, count, objective)?;
        if let Fault::Slow(pause) = self.fault
            && self.done + 1 >= self.at
        {
            std::thread::sleep(pause);
        }
        Ok(outs)
    }

    fn takes_batches(&self) -> bool {
        self.inner.takes_batches()
    }

    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        let stepped = self.inner.optimizer_step(lr, scaler, clip)?;
        self.phase += 1;
        if self.phase == self.groups {
            self.phase = 0;
            self.done += 1;
            if self.done == self.at {
                match self.fault {
                    Fault::Panic => {
                        panic!("injected failure after step {} ({FAULT_VAR})", self.at)
                    }
                    // The rank stops making progress, as a stuck kernel or a deadlock would.
                    Fault::Hang => loop {
                        std::thread::sleep(Duration::from_secs(3600));
                    },
                    _ => {}
                }
            }
        }
        Ok(stepped)
    }

    fn full_model(&mut self) -> Result<M> {
        self.inner.full_model()
    }

    fn optimizer_state(&mut self) -> Result<Option<OptimState>> {
        self.inner.optimizer_state()
    }

    fn load_optimizer_state(&mut self, state: &OptimState) -> Result<()> {
        self.inner.load_optimizer_state(state)
    }

    fn optimizer_states(&mut self) -> Result<Option<Vec<(String, OptimState)>>> {
        self.inner.optimizer_states()
    }

    fn load_optimizer_states(&mut self, states: &[(String, OptimState)]) -> Result<()> {
        self.inner.load_optimizer_states(states)
    }

    fn checkpoint_share(&mut self) -> Result<crate::optim::Share>
    where
        M: burn::module::Module,
    {
        self.inner.checkpoint_share()
    }

    fn load_optimizer_shards(
        &mut self,
        source: &dyn crate::optim::Source,
        groups: &[String],
    ) -> Result<()> {
        self.inner.load_optimizer_shards(source, groups)
    }

    fn load_param_shards(&mut self, source: &dyn crate::optim::Source) -> Result<()> {
        self.inner.load_param_shards(source)
    }

    fn select_group(&mut self, group: usize) -> Result<()> {
        self.inner.select_group(group)
    }

    fn check_replicas(&mut self, step: usize) -> Result<()> {
        self.inner.check_replicas(step)
    }

    fn report(&mut self) -> Result<Report> {
        self.inner.report()
    }

    fn memory(&self) -> Memory {
        self.inner.memory()
    }

    fn take_sync_seconds(&mut self) -> f64 {
        self.inner.take_sync_seconds()
    }

    fn nonfinite(&self) -> bool {
        self.inner.nonfinite()
    }

    fn skipped_on_device(&mut self) -> Result<Vec<usize>> {
        self.inner.skipped_on_device()
    }

    fn decided_on_device(&self) -> bool {
        self.inner.decided_on_device()
    }
}
