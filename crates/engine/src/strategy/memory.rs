//! The bytes a rank holds of the model's training state, counted where its strategy
//! allocates and drops them.

use serde::Serialize;

/// Bytes now and at the peak.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counter {
    /// Bytes held now.
    pub now: usize,
    /// The most held at once so far.
    pub peak: usize,
}

impl Counter {
    pub(crate) fn add(&mut self, bytes: usize) {
        self.now += bytes;
        self.peak = self.peak.max(self.now);
    }
    pub(crate) fn sub(&mut self, bytes: usize) {
        self.now = self.now.saturating_sub(bytes);
    }
    pub(crate) fn set(&mut self, bytes: usize) {
        self.now = bytes;
        self.peak = self.peak.max(bytes);
    }
}

/// What one rank holds of the model's training state, counted where the strategy allocates
/// and drops it: parameters (master and compute copies, gathered units), gradients (whole,
/// per unit, or the rank's shard) and optimizer state. Activations are not counted (the
/// memory pool and the process's resident memory show them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Memory {
    /// Parameter bytes.
    pub params: Counter,
    /// Gradient bytes.
    pub grads: Counter,
    /// Optimizer-state bytes.
    pub optim: Counter,
    /// The most the three held together.
    pub total_peak: usize,
    /// Bytes of frozen parameters the rank holds (not trained: no gradient, no optimizer
    /// state; whole on each rank, or placed by the strategy).
    pub frozen: usize,
    /// The most the device's memory pool had in use when sampled (after each micro-step and
    /// optimizer step), where the backend reports a pool.
    pub pool_peak: Option<u64>,
}

impl Memory {
    pub(crate) fn note(&mut self) {
        self.total_peak = self
            .total_peak
            .max(self.params.now + self.grads.now + self.optim.now);
    }
}
