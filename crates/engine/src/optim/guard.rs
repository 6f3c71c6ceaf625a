//! A step decided on the device: whether the optimizer takes a step whose gradient may not be
//! finite, decided where the gradient is, without the host waiting for it.
//!
//! Reading a GPU's tensor waits for everything queued before it. A step that reads whether
//! its gradient was finite therefore waits once per step, and the device idles while the host
//! queues the next. Here the flag stays on the device: the update copies every element
//! through unchanged when it is 0 (`kiln_models::cube::adamw` with a guard), the steps' flags
//! are kept, and the host reads them all at once when it reads anything else (a log line, a
//! checkpoint, a validation: [`Pending::settle`]), then acts on each skipped step in order as
//! it would have at the step.
//!
//! AdamW's bias corrections depend on how many steps were taken. The host counts every
//! guarded step as taken and forgets the skipped ones when it reads them; in between, the
//! update takes its corrections from a table of the host's count less 0, 1, 2, … skipped steps
//! ([`corrections`]) at the device's count of skipped steps, so that a step after a skipped
//! one is the step it would have been had that one been refused on the host.

use burn::prelude::*;

use super::fused::{Adam, correction};

/// Guarded steps since the host last read their flags.
#[derive(Default)]
pub(super) struct Pending {
    /// Each step's flag (`[1]`: 1 taken, 0 skipped), in order.
    taken: Vec<Tensor<1>>,
    /// How many of them were skipped, on the device (`[1]`).
    skipped: Option<Tensor<1>>,
}

impl Pending {
    /// Adds a step's flag (`[1]`, f32: 1 taken, 0 not) and returns its guard, `[taken,
    /// skipped]`: the flag and the steps skipped since the last read, this one included.
    pub(super) fn add(&mut self, taken: Tensor<1>) -> Tensor<1> {
        let refused = taken.clone().neg().add_scalar(1.0);
        let skipped = match self.skipped.take() {
            Some(before) => before + refused,
            None => refused,
        };
        self.taken.push(taken.clone());
        self.skipped = Some(skipped.clone());
        Tensor::cat(vec![taken, skipped], 0)
    }

    /// Guarded steps not yet read, the latest included.
    pub(super) fn len(&self) -> usize {
        self.taken.len()
    }

    /// Reads every pending flag (one read), forgets them and returns the positions (from 0,
    /// the first step since the last read) of the steps that were skipped.
    pub(super) fn settle(&mut self) -> Vec<usize> {
        self.skipped = None;
        let flags = std::mem::take(&mut self.taken);
        if flags.is_empty() {
            return Vec::new();
        }
        let read = Tensor::cat(flags, 0).into_data().convert::<f32>();
        let values = read.iter::<f32>();
        values
            .enumerate()
            .filter(|(_, taken)| *taken == 0.0)
            .map(|(i, _)| i)
            .collect()
    }
}

/// `[1 − β₁ᵗ, 1 − β₂ᵗ]` for `t` = `time`, `time − 1`, …, `time − (back − 1)`, one pair after
/// another (`time ≥ back`: every `t` at least 1), on `device`: the corrections of a step that
/// is the host's step `time` less the skipped steps it has not read yet.
pub(super) fn corrections(adam: Adam, time: usize, back: usize, device: &Device) -> Tensor<1> {
    assert!(
        back >= 1 && time >= back,
        "step {time} with {back} steps pending"
    );
    let pairs: Vec<f32> = (0..back)
        .flat_map(|s| {
            let t = time - s;
            [correction(adam.beta_1, t), correction(adam.beta_2, t)]
        })
        .collect();
    let n = pairs.len();
    Tensor::<1>::from_data(TensorData::new(pairs, [n]), device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flags_are_read_once_and_the_skipped_counted_on_the_device() {
        let device = Device::flex();
        let flag = |x: f32| Tensor::<1>::from_data([x], &device);
        let read = |t: Tensor<1>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        let mut pending = Pending::default();
        assert_eq!(read(pending.add(flag(1.0))), vec![1.0, 0.0]);
        assert_eq!(read(pending.add(flag(0.0))), vec![0.0, 1.0]);
        assert_eq!(read(pending.add(flag(1.0))), vec![1.0, 1.0]);
        assert_eq!(read(pending.add(flag(0.0))), vec![0.0, 2.0]);
        assert_eq!(pending.len(), 4);
        assert_eq!(pending.settle(), vec![1, 3]);
        assert_eq!(pending.len(), 0);
        assert_eq!(pending.settle(), Vec::<usize>::new());
        // Counting starts again after a read.
        assert_eq!(read(pending.add(flag(1.0))), vec![1.0, 0.0]);
    }

    #[test]
    fn the_table_holds_the_corrections_of_each_count_of_skipped_steps() {
        let adam = Adam {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-8,
        };
        let table = corrections(adam, 5, 3, &Device::flex());
        let v = table
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap();
        let expect: Vec<f32> = [5, 4, 3]
            .iter()
            .flat_map(|&t| [1f32 - 0.9f32.powi(t), 1f32 - 0.999f32.powi(t)])
            .collect();
        assert_eq!(v, expect);
    }
}
