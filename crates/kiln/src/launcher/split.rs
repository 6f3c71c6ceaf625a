//! The same samples per step on the devices left: the per-device batch and the accumulation
//! of a restart.

use kiln_engine::error::{Error, Result};

/// How a step's samples are split: per device, and in micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// Samples per device per micro-batch (`train.batch_size`).
    pub batch: usize,
    /// Micro-batches per step (`train.accumulate`).
    pub accumulate: usize,
}

/// The split that keeps `samples` per step on `devices` devices, nearest `now`: the same
/// per-device batch with more (or fewer) accumulation where that divides, so that no device
/// holds more than it did; otherwise the smallest accumulation at least `now`'s whose batch
/// is whole. Refused in one line where `devices` cannot share `samples` equally.
pub fn keep_samples(samples: usize, devices: usize, now: Split) -> Result<Split> {
    let per_device = |acc: usize| {
        (acc > 0 && samples.is_multiple_of(devices * acc)).then(|| samples / (devices * acc))
    };
    if devices > 0 && samples.is_multiple_of(devices * now.batch) {
        let accumulate = samples / (devices * now.batch);
        if accumulate > 0 {
            return Ok(Split {
                batch: now.batch,
                accumulate,
            });
        }
    }
    if let Some(most) = samples.checked_div(devices) {
        for acc in now.accumulate.max(1)..=most {
            if let Some(batch) = per_device(acc) {
                return Ok(Split {
                    batch,
                    accumulate: acc,
                });
            }
        }
        for acc in (1..now.accumulate).rev() {
            if let Some(batch) = per_device(acc) {
                return Ok(Split {
                    batch,
                    accumulate: acc,
                });
            }
        }
    }
    Err(Error::config(format!(
        "cannot keep {samples} samples per step on {devices} device(s): it is not a multiple \
         of the device count"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_keeps_its_samples_on_fewer_devices() {
        let now = Split {
            batch: 8,
            accumulate: 1,
        };
        // 2 hosts × 2 devices → 1 host: the batch stays, the accumulation doubles.
        assert_eq!(
            keep_samples(32, 2, now).unwrap(),
            Split {
                batch: 8,
                accumulate: 2
            }
        );
        // 3 devices → 2: 48 samples, batch 8 does not divide 2 × 8 × k for 48/16 = 3. It does:
        assert_eq!(keep_samples(48, 2, now).unwrap().accumulate, 3);
        // 24 samples on 4 devices from batch 8: 24 / 4 = 6 a device, in one micro-batch.
        assert_eq!(
            keep_samples(24, 4, now).unwrap(),
            Split {
                batch: 6,
                accumulate: 1
            }
        );
        let e = keep_samples(10, 3, now).unwrap_err().to_string();
        assert!(e.contains("10 samples") && e.contains("3 device"), "{e}");
    }
}
