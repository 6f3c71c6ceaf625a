//! Data order and batches: the distributed sampler, the random numbers of a sample's
//! augmentation ([`sample_rng`]), and the image batcher. The loop's loader (a rank's batches,
//! built on its thread or ahead of it) is `trainer/loader.rs`; Burn's `Dataset`/`Batcher` as
//! a workload is [`crate::BurnWorkload`].
//!
//! The sampler makes the data order independent of the device count: every epoch is one global
//! shuffle from `(seed, epoch)`, cut into global micro-batches of `world × batch` samples, and
//! rank `r` takes the `r`-th slice of each. The samples of global step `s` on N devices with
//! batch `b` are therefore exactly those of step `s` on one device with batch `N·b`.

use std::cell::Cell;

use burn::prelude::*;
use kiln_datasets::ImageDataset;
pub use kiln_datasets::rng::SplitMix64;
use kiln_datasets::rng::permutation;
use kiln_models::{ImageBatch, InputSpec};

thread_local! {
    /// The run's seed and the optimizer step of the training batch this thread is building.
    static BUILDING: Cell<Option<(u64, usize)>> = const { Cell::new(None) };
}

/// Runs `f` (a workload's training batch) with [`sample_rng`] keyed to `seed` and `step`.
pub(crate) fn building<T>(seed: u64, step: usize, f: impl FnOnce() -> T) -> T {
    let before = BUILDING.replace(Some((seed, step)));
    let out = f();
    BUILDING.set(before);
    out
}

/// The random numbers of sample `index`'s augmentation (a random crop, a flip, noise) in the
/// training batch being built: a function of the run's seed, the optimizer step and the
/// sample, so that a batch is the same bits whichever thread builds it (`data.workers`), on
/// any number of devices, and after a resume. Call it from [`Workload::train_batch_at`]
/// (or a Burn `Dataset`/`Batcher` trained through [`BurnData`](crate::BurnData)) rather than
/// a thread-local or the backend's random numbers, which depend on who draws first. Outside a
/// batch build it is keyed to seed 0, step 0.
///
/// [`Workload::train_batch_at`]: crate::Workload::train_batch_at
pub fn sample_rng(index: usize) -> SplitMix64 {
    let (seed, step) = BUILDING.get().unwrap_or((0, 0));
    let mut mix = SplitMix64::new(seed ^ 0xa6d3_e9f1_4b27_c085);
    let a = mix.next_u64() ^ (step as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    SplitMix64::new(SplitMix64::new(a).next_u64() ^ index as u64)
}

/// Where a replica's samples come from at every step of every epoch.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: usize,
    seed: u64,
    world: usize,
    batch: usize,
    accumulate: usize,
    drop_last: bool,
}

impl DistributedSampler {
    /// A sampler over `len` samples for `world` replicas of `batch` samples each, with
    /// `accumulate` micro-batches per optimizer step.
    pub fn new(
        len: usize,
        seed: u64,
        world: usize,
        batch: usize,
        accumulate: usize,
        drop_last: bool,
    ) -> Self {
        Self {
            len,
            seed,
            world,
            batch,
            accumulate,
            drop_last,
        }
    }

    /// Samples consumed by one optimizer step across all replicas.
    pub fn samples_per_step(&self) -> usize {
        self.world * self.batch * self.accumulate
    }

    /// Optimizer steps in one epoch: the last one wraps around to the start of the epoch's
    /// order, unless `drop_last` drops it.
    pub fn steps_per_epoch(&self) -> usize {
        let per = self.samples_per_step();
        if self.drop_last {
            self.len / per
        } else {
            self.len.div_ceil(per)
        }
    }

    /// The epoch's global order.
    pub fn epoch_order(&self, epoch: usize) -> Vec<usize> {
        let seed = SplitMix64::new(self.seed ^ 0x5eed_da7a).next_u64() ^ (epoch as u64);
        permutation(self.len, SplitMix64::new(seed).next_u64())
    }

    /// Indices rank `rank` trains on at micro-step `micro` of step `step` of the epoch whose
    /// order is `order`.
    pub fn indices(&self, order: &[usize], step: usize, micro: usize, rank: usize) -> Vec<usize> {
        let global_micro = step * self.accumulate + micro;
        let start = global_micro * self.world * self.batch + rank * self.batch;
        (start..start + self.batch)
            .map(|i| order[i % order.len()])
            .collect()
    }
}

/// The contiguous part of an evaluation set that `rank` scores: every sample exactly once
/// across ranks, shares differing by at most one sample.
pub fn eval_shard(len: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    let base = len / world;
    let extra = len % world;
    let start = rank * base + rank.min(extra);
    let size = base + usize::from(rank < extra);
    start..start + size
}

/// Turns samples of an [`ImageDataset`] into tensors on one device.
#[derive(Debug, Clone)]
pub struct ImageBatcher {
    device: Device,
}

impl ImageBatcher {
    /// A batcher that creates tensors on `device`.
    pub fn new(device: Device) -> Self {
        Self { device }
    }

    /// The batch of `indices`, pixels scaled to `[0, 1]`.
    pub fn batch(&self, data: &ImageDataset, indices: &[usize]) -> ImageBatch {
        let pixels = data.pixels();
        let scale = 1.0 / f32::from(data.max_value);
        let mut images = Vec::with_capacity(indices.len() * pixels);
        let mut targets = Vec::with_capacity(indices.len());
        for &i in indices {
            images.extend(data.image(i).iter().map(|&p| f32::from(p) * scale));
            targets.push(i64::from(data.label(i)));
        }
        let n = indices.len();
        ImageBatch {
            images: Tensor::from_data(
                TensorData::new(images, [n, 1, data.height, data.width]),
                &self.device,
            ),
            targets: Tensor::from_data(TensorData::new(targets, [n]), &self.device),
        }
    }
}

/// The model input shape of an image dataset.
pub fn input_spec(data: &ImageDataset) -> InputSpec {
    InputSpec {
        channels: 1,
        height: data.height,
        width: data.width,
        num_classes: data.num_classes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_samples_do_not_depend_on_device_count() {
        let n = 103;
        for accumulate in [1, 2] {
            let one = DistributedSampler::new(n, 7, 1, 8, accumulate, false);
            let four = DistributedSampler::new(n, 7, 4, 2, accumulate, false);
            assert_eq!(one.steps_per_epoch(), four.steps_per_epoch());
            for epoch in 0..2 {
                let order = one.epoch_order(epoch);
                assert_eq!(order, four.epoch_order(epoch));
                for step in 0..one.steps_per_epoch() {
                    for micro in 0..accumulate {
                        let single = one.indices(&order, step, micro, 0);
                        let multi: Vec<usize> = (0..4)
                            .flat_map(|r| four.indices(&order, step, micro, r))
                            .collect();
                        assert_eq!(single, multi);
                    }
                }
            }
        }
    }

    #[test]
    fn step_samples_do_not_depend_on_the_split_into_devices_and_accumulation() {
        // What a restart on fewer devices keeps: 32 samples a step as 2 × 8 × 2, 1 × 8 × 4
        // and 4 × 8 × 1 (devices × batch × accumulation) are the same samples.
        let n = 200;
        let splits = [(2, 8, 2), (1, 8, 4), (4, 8, 1), (1, 32, 1)];
        let samplers: Vec<_> = splits
            .iter()
            .map(|&(w, b, a)| (DistributedSampler::new(n, 5, w, b, a, false), w, a))
            .collect();
        let order = samplers[0].0.epoch_order(0);
        for step in 0..samplers[0].0.steps_per_epoch() {
            let order = &order;
            let step_samples = |(s, w, a): &(DistributedSampler, usize, usize)| {
                let mut all = Vec::new();
                for m in 0..*a {
                    for r in 0..*w {
                        all.extend(s.indices(order, step, m, r));
                    }
                }
                all.sort_unstable();
                all
            };
            let first = step_samples(&samplers[0]);
            for other in &samplers[1..] {
                assert_eq!(step_samples(other), first, "step {step}");
            }
        }
    }

    #[test]
    fn epochs_cover_every_sample_and_differ() {
        let s = DistributedSampler::new(50, 1, 2, 5, 1, false);
        let a = s.epoch_order(0);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_ne!(a, s.epoch_order(1));
        assert_eq!(s.steps_per_epoch(), 5);
        assert_eq!(
            DistributedSampler::new(51, 1, 2, 5, 1, true).steps_per_epoch(),
            5
        );
        assert_eq!(
            DistributedSampler::new(51, 1, 2, 5, 1, false).steps_per_epoch(),
            6
        );
    }

    #[test]
    fn eval_shards_partition_the_set() {
        for len in [0, 1, 7, 100] {
            for world in 1..5 {
                let mut all = Vec::new();
                for r in 0..world {
                    all.extend(eval_shard(len, world, r));
                }
                assert_eq!(all, (0..len).collect::<Vec<_>>());
            }
        }
    }
}
