//! The end of a rank's run: the final validation, every rank's memory figures, and on the
//! process's first rank the summary and the model as it leaves the run.

use super::log::Logger;
use super::worker::{Outcome, Ran, Worker};
use super::workload::Workload;
use crate::comm::pack;
use crate::config::name_of;
use crate::error::Result;
use crate::metrics::{PoolPages, Summary};
use crate::monitor::process_memory_mib;
use crate::state::LoopState;
use crate::strategy::Strategy;
use burn::module::Module;

impl<W: Workload> Worker<'_, W> {
    /// After the last step (or a stop): the final validation if none ran at this step, the
    /// memory figures of every rank, and on the process's first rank the summary and the
    /// model as it leaves the run (f32).
    pub(super) fn finish(
        &self,
        strategy: &mut dyn Strategy<W::Model, W::Batch>,
        state: LoopState,
        mut log: Logger,
        ran: Ran,
    ) -> Result<Outcome<W::Model>> {
        let s = self.settings;
        let model = strategy.full_model()?;
        let (params_trainable, params_total) = crate::weights::count_params(&model);
        let mut last_val = ran.val.last;
        let step = state.step;
        if ran.val.at != Some(step)
            && self.workload.eval_len() > 0
            && (step > 0 || s.train.max_steps == Some(0))
            && ran.stopped_by.is_none()
        {
            last_val = Some(self.validate(&model)?.0);
        }
        log.finish();
        let wall = ran.wall + ran.started.elapsed().as_secs_f64();
        let m = strategy.memory();
        let pool = m.pool_peak.unwrap_or(u64::MAX);
        let counts = [m.params.peak, m.grads.peak, m.optim.peak, m.total_peak].map(|c| c as u64);
        let mut mine = counts.to_vec();
        mine.push(pool);
        mine.push(m.frozen as u64);
        let memories = pack::gather_counts(self.place.comm.as_ref(), &mine)?;
        if self.place.local != 0 {
            return Ok(Outcome { lead: None });
        }
        let per_rank = |i: usize| memories.iter().map(|m| m[i] as usize).collect();
        let summary = Summary {
            steps: step,
            epochs: step as f64 / self.steps.sampler.steps_per_epoch() as f64,
            final_train_loss: log.last_loss,
            val_loss: last_val.map(|v| v.0),
            val_accuracy: last_val.and_then(|v| v.1),
            wall_seconds: wall,
            samples_per_sec: state.samples as f64 / wall.max(1e-9),
            devices: self.world() / s.parallel.sub_replicas.max(1),
            sub_replicas: s.parallel.sub_replicas.max(1),
            params_trainable,
            params_total,
            strategy: self.setup.name(),
            tp: self.setup.tp,
            tp_floats_predicted: None,
            precision: self.policy.name(),
            accelerator: s.parallel.accelerator.clone(),
            recompute: name_of(&s.recompute.mode),
            step_seconds: median(&mut log.step_times),
            flops_per_sample: self.workload.flops_per_sample(),
            start_rss_mib: ran.start_rss_mib,
            peak_rss_mib: process_memory_mib("VmHWM"),
            startup_peak_rss_mib: crate::monitor::earlier_resident_peak_mib(),
            peak_heap_mib: crate::heap::peak().map(|b| b as f64 / (1024.0 * 1024.0)),
            memory_holds: s
                .parallel
                .memory_limit_mib
                .map(|_| crate::heap::times_held()),
            param_bytes_per_rank: per_rank(0),
            grad_bytes_per_rank: per_rank(1),
            optim_bytes_per_rank: per_rank(2),
            peak_bytes_per_rank: per_rank(3),
            pool_peak_bytes_per_rank: memories
                .iter()
                .map(|m| (m[4] != u64::MAX).then_some(m[4]))
                .collect(),
            frozen_bytes_per_rank: per_rank(5),
            device_memory_peak: self
                .monitor
                .map(|m| m.memory_peaks())
                .filter(|p| p.iter().any(|d| !d.is_empty())),
            device_pools: pools_of(&self.place.device),
            plan: None,
            checkpoint_stall_s: ran.checkpoint_stalls,
            peak_heap_before_checkpoints_mib: ran
                .heap_before_checkpoints
                .map(|b| b as f64 / (1024.0 * 1024.0)),
            processes: s.parallel.processes.count,
            stopped_by: ran.stopped_by,
            stopped_early: ran.stopped_early,
        };
        // The exported model is f32 whatever the training precision.
        let model = self.policy.export(model);
        Ok(Outcome {
            lead: Some((summary, model.valid())),
        })
    }
}

/// The pools of `device`'s allocator at this moment, `None` where it reports none.
fn pools_of(device: &burn::tensor::Device) -> Option<Vec<PoolPages>> {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let pools = device.memory_pool_report()?;
    (!pools.is_empty()).then(|| {
        pools
            .iter()
            .map(|p| PoolPages {
                page_mib: mib(p.page_size),
                pages: p.pages,
                pages_peak: p.pages_peak,
                largest_alloc_mib: mib(p.largest_alloc),
            })
            .collect()
    })
}

/// The median of `values` (sorted in place), `None` when empty.
pub fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    })
}
