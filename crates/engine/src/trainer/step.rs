//! One optimizer step of a rank: each parameter group's micro-batches and update, and what a
//! step whose gradients were not finite does.

use burn::prelude::*;
use kiln_models::StepOutput;

use super::checkpointer::Checkpointer;
use super::loader::Feed;
use super::log::Logger;
use super::worker::Worker;
use super::workload::Workload;
use crate::checkpoint;
use crate::error::{Error, Result};
use crate::exec::draws;
use crate::state::LoopState;
use crate::strategy::Strategy;
use crate::trainer::log::Times;
use std::time::Instant;

impl<W: Workload> Worker<'_, W> {
    /// One optimizer step: each parameter group's micro-steps and update in turn (one group
    /// for most models), a later group seeing what an earlier one stepped.
    pub(super) fn train_step(
        &self,
        state: &mut LoopState,
        feed: &mut Feed<'_, W>,
        strategy: &mut dyn Strategy<W::Model, W::Batch>,
        log: &mut Logger,
        saver: &Checkpointer,
    ) -> Result<()> {
        let t = &self.settings.train;
        if state.step_in_epoch == self.steps.sampler.steps_per_epoch() {
            state.epoch += 1;
            state.step_in_epoch = 0;
        }
        let lrs: Vec<f64> = self
            .steps
            .schedules
            .iter()
            .enumerate()
            .map(|(g, s)| {
                let reductions = state.plateaus.get(g).map_or(0, |p| p.acted);
                self.workload
                    .lr(g, state.step, s.lr_after(state.step, reductions))
            })
            .collect();
        state.lr = lrs[0];
        let micros = self.steps.micros;
        let objective = objective(micros, state.scaler.as_ref().map(|s| s.scale as f32));
        // Whether to wait for the device after the micro-steps (below): at every step, or
        // where the step's check stays on the device (`train.host_waits = "log"`, a rank
        // alone, as the last step's did) on the steps that log, the others queueing their
        // work behind the one before. A step that reads its check waits there anyway, and
        // the wait belongs to compute.
        let next = state.step + 1;
        let split = self.waits_each_step()
            || !strategy.decided_on_device()
            || log.due(next, next == self.steps.total);
        for (phase, &lr) in lrs.iter().enumerate() {
            let t0 = Instant::now();
            if lrs.len() > 1 {
                strategy.select_group(phase)?;
            }
            strategy.begin_step()?;
            // The strategy takes each micro-batch when it needs it; building it, or waiting
            // for the loader threads to, is data time.
            let mut data = 0.0;
            let step = state.step;
            let mut batches = (0..micros).map(|micro| {
                let t0 = Instant::now();
                let batch = feed.take(step, phase, micro).map(|b| {
                    self.policy
                        .cast_batch(b, |b, dtype| self.workload.cast_batch(b, dtype))
                });
                data += t0.elapsed().as_secs_f64();
                batch
            });
            if self.draws {
                let (seed, tp) = (self.settings.seed, self.setup.tp);
                draws::begin(seed, self.rank(), tp, state.step, phase, &self.place.device);
            }
            let outs = strategy.micro_steps(&mut batches, micros, &objective);
            draws::end();
            let outs = outs?;
            drop(batches);
            // A GPU runs the queued forward and backward after the host has returned from
            // them: waiting here counts that time as compute, not as the optimizer step that
            // would otherwise wait for it (a CUDA run logged "optim 88 %" without this). The
            // CPU's ops run as they are called, so there it returns at once.
            if split {
                self.sync_device(step + 1)?;
            }
            // Collectives inside the micro-steps (ZeRO's reduce-scatters and gathers) count as
            // synchronisation, not compute.
            let inside = strategy.take_sync_seconds();
            let compute = t0.elapsed().as_secs_f64() - data - inside;
            let t2 = Instant::now();
            strategy.optimizer_step(lr, state.scaler.as_mut(), t.grad_clip)?;
            let sync = strategy.take_sync_seconds();
            let optim = t2.elapsed().as_secs_f64() - sync;
            let times = Times {
                data,
                compute,
                sync: inside + sync,
                optim,
            };
            log.add(phase, lr, &outs, times);
            if strategy.nonfinite() {
                self.nonfinite(state.step + 1, phase, &outs, log, saver)?;
            }
        }
        state.step += 1;
        state.step_in_epoch += 1;
        state.samples += self.steps.sampler.samples_per_step() as u64;
        log.step_done(state.step, self.steps.sampler.samples_per_step());
        self.place.recorder.step_done();
        if t.check_replicas && self.world() > 1 {
            strategy.check_replicas(state.step)?;
        }
        Ok(())
    }

    /// Waits for everything queued on the rank's device, in step `step`.
    pub(super) fn sync_device(&self, step: usize) -> Result<()> {
        self.place.device.sync().map_err(|e| {
            Error::Device(format!(
                "{:?} failed in step {step}: {e}",
                self.place.device
            ))
        })
    }

    /// The steps since the last settling that the device refused for a gradient that was not
    /// finite (`train.host_waits = "log"`), read now that the host waits anyway: each counts
    /// under `train.skip_nonfinite` as at its step, and one past it stops the run naming the
    /// step. `from` is the step of the last settling; `now` this step.
    pub(super) fn settle(
        &self,
        strategy: &mut dyn Strategy<W::Model, W::Batch>,
        (from, now): (usize, usize),
        log: &mut Logger,
        saver: &Checkpointer,
    ) -> Result<()> {
        self.sync_device(now)?;
        for offset in strategy.skipped_on_device()? {
            let allowed = self.settings.train.skip_nonfinite;
            if log.skipped < allowed {
                log.skipped += 1;
                continue;
            }
            saver.wait()?;
            let step = from + offset + 1;
            return Err(Error::Training(format!(
                "step {step}: a non-finite loss or gradient; the step was not taken (the device \
                 decided it, and the host read it at step {now}: train.host_waits = \"step\" \
                 reads it at each step and names the micro-batch) and the newest checkpoint {} \
                 (train.skip_nonfinite = {allowed} lets a run skip such steps)",
                self.newest_checkpoint()
            )));
        }
        Ok(())
    }

    /// The newest checkpoint, as an error message names it.
    fn newest_checkpoint(&self) -> String {
        checkpoint::list(&self.settings.output.run_dir)
            .pop()
            .map_or("none was written".to_string(), |(_, d)| {
                format!("{} is intact", d.display())
            })
    }

    /// A step whose gradients were not finite (every rank saw the same flag): within
    /// `train.skip_nonfinite` it is skipped (the parameters stay as they were), past it the
    /// run stops, before anything is written for this step.
    fn nonfinite(
        &self,
        step: usize,
        phase: usize,
        outs: &[StepOutput],
        log: &mut Logger,
        saver: &Checkpointer,
    ) -> Result<()> {
        let allowed = self.settings.train.skip_nonfinite;
        if log.skipped < allowed {
            log.skipped += 1;
            return Ok(());
        }
        let bad = outs
            .iter()
            .position(|o| !o.loss.clone().into_scalar::<f32>().is_finite())
            .map_or(-1.0, |m| m as f32);
        let all = self.place.comm.all_gather(&[bad])?;
        let at: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, m)| **m >= 0.0)
            .map(|(r, m)| format!("rank {r} micro-batch {}", *m as usize))
            .collect();
        let mut what = if at.is_empty() {
            "a non-finite gradient (every loss was finite)".to_string()
        } else {
            format!("a non-finite loss ({})", at.join(", "))
        };
        if let Some(group) = self.steps.groups.get(phase) {
            what = format!("{what} in parameter group {group:?}");
        }
        // The checkpoint being written lands first: the newest is then the one named.
        saver.wait()?;
        let kept = self.newest_checkpoint();
        Err(Error::Training(format!(
            "step {step}: {what}; the step was not taken and the newest checkpoint {kept} \
             (train.skip_nonfinite = {allowed} lets a run skip such steps)"
        )))
    }
}

/// What a micro-batch's backward differentiates: its mean loss divided by the micro-batches of
/// the step, times the loss scale.
fn objective(micros: usize, scale: Option<f32>) -> impl Fn(Tensor<1>) -> Tensor<1> {
    move |loss: Tensor<1>| {
        let loss = if micros > 1 {
            loss.div_scalar(micros as f32)
        } else {
            loss
        };
        match scale {
            Some(scale) => loss.mul_scalar(scale),
            None => loss,
        }
    }
}
