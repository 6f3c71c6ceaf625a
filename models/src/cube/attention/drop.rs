//! Dropout on the attention weights as the kernels draw it: the seed, the threshold and the
//! hash, the same on the host and in the kernels.

use super::kernels::DropArgsLaunch;

/// Dropout on the attention weights, drawn by the kernels themselves: whether the weight of
/// query row `i` on key `j` of head `h` in batch row `b` is kept is a function of the seed and
/// that place alone ([`AttentionDropout::keeps`]), so the forward and both backward kernels
/// recompute the same mask and none is stored. `prob = 0`: no dropout.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionDropout {
    /// The draw's seed.
    pub seed: u64,
    /// The probability of dropping a weight; the kept ones are scaled by `1 / (1 − prob)`.
    pub prob: f32,
    /// The first of these heads in the whole (a tensor-parallel rank's heads are a part of it).
    pub first_head: usize,
    /// The heads of the whole.
    pub heads: usize,
}

/// Knuth's multiplicative constant's cousins: a 32-bit integer hash (two multiply-xorshift
/// rounds), the same on the host and in the kernels.
pub(crate) fn mix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// A dropout probability as the kernels compare it (attention's and [`crate::cube::dropout`]'s):
/// an element whose hash's top 24 bits fall below it is dropped.
pub(crate) fn threshold(prob: f32) -> u32 {
    (f64::from(prob) * f64::from(1u32 << 24)).round() as u32
}

/// The factor of a kept element at dropout probability `prob`.
pub(crate) fn inv_keep(prob: f32) -> f32 {
    (1.0 / (1.0 - f64::from(prob))) as f32
}

impl AttentionDropout {
    /// The dropped fraction as the kernels compare it.
    fn threshold(&self) -> u32 {
        threshold(self.prob)
    }

    /// The factor of a kept weight.
    fn inv_keep(&self) -> f32 {
        inv_keep(self.prob)
    }

    /// Whether the weight of query row `i` on key `j` of local head `h` in batch row `b` is
    /// kept — what the kernels compute.
    pub fn keeps(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let bh = (b * self.heads + self.first_head + h) as u32;
        let head = mix((self.seed as u32) ^ mix(((self.seed >> 32) as u32) ^ bh));
        let row = mix(head ^ i as u32);
        (mix(row ^ mix(j as u32)) >> 8) >= self.threshold()
    }
}

impl AttentionDropout {
    /// The kernels' arguments.
    pub(super) fn args(&self) -> DropArgsLaunch {
        DropArgsLaunch::new(
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.threshold(),
            self.inv_keep(),
            self.first_head as u32,
            self.heads as u32,
        )
    }
}
