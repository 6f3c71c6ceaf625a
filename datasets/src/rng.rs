//! A tiny deterministic random number generator for reproducible splits and shuffles.
//!
//! SplitMix64 is used because it is a few lines long, has no dependencies, passes the usual
//! statistical batteries well enough for shuffling data, and yields the same stream on every
//! platform, so a seed in a config file always means the same split.

/// The SplitMix64 generator: a 64-bit counter passed through a strong mixing function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

/// The odd constant added to the state at each step (2^64 divided by the golden ratio).
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

impl SplitMix64 {
    /// Creates a generator whose stream is fully determined by `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// Returns the next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Returns the next 32 uniformly distributed bits.
    pub fn next_u32(&mut self) -> u32 {
        // The high half is used because it is the better-mixed half of the output.
        (self.next_u64() >> 32) as u32
    }

    /// Returns a uniform `f64` in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        // 53 bits fill the mantissa exactly, so every value is representable and 1.0 is never hit.
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Returns a uniform `f32` in `[0, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        // 24 bits fill the f32 mantissa exactly, for the same reason as in `next_f64`.
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// Returns a uniform integer in `0..bound` without modulo bias.
    ///
    /// # Panics
    ///
    /// Panics if `bound` is zero, since the range would be empty.
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "SplitMix64::below needs a non-zero bound");
        // Lemire's multiply-and-shift maps 64 random bits onto the range; the rare draws that
        // would over-represent some values are rejected so every outcome is equally likely.
        let mut product = u128::from(self.next_u64()) * u128::from(bound);
        if (product as u64) < bound {
            let threshold = bound.wrapping_neg() % bound;
            while (product as u64) < threshold {
                product = u128::from(self.next_u64()) * u128::from(bound);
            }
        }
        (product >> 64) as u64
    }

    /// Returns a uniform index in `0..bound`.
    ///
    /// # Panics
    ///
    /// Panics if `bound` is zero.
    pub fn index(&mut self, bound: usize) -> usize {
        self.below(bound as u64) as usize
    }

    /// Shuffles `items` in place with the Fisher–Yates algorithm, so every order is equally likely.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for last in (1..items.len()).rev() {
            let pick = self.index(last + 1);
            items.swap(last, pick);
        }
    }
}

/// Returns a random permutation of `0..n` determined entirely by `seed`.
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    SplitMix64::new(seed).shuffle(&mut order);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_reference_stream() {
        // Published reference outputs of SplitMix64 for seed 1234567.
        let mut rng = SplitMix64::new(1_234_567);
        let expected = [
            6_457_827_717_110_365_317,
            3_203_168_211_198_807_973,
            9_817_491_932_198_370_423,
            4_593_380_528_125_082_431,
            16_408_922_859_458_223_821,
        ];
        for want in expected {
            assert_eq!(rng.next_u64(), want);
        }
    }

    #[test]
    fn floats_stay_in_unit_interval() {
        let mut rng = SplitMix64::new(7);
        for _ in 0..10_000 {
            let x = rng.next_f64();
            assert!((0.0..1.0).contains(&x));
            let y = rng.next_f32();
            assert!((0.0..1.0).contains(&y));
        }
    }

    #[test]
    fn below_covers_range_evenly() {
        let mut rng = SplitMix64::new(42);
        let mut counts = [0usize; 7];
        for _ in 0..70_000 {
            counts[rng.index(7)] += 1;
        }
        // Each bucket expects 10,000; a 5% band is many standard deviations wide.
        for count in counts {
            assert!((9_500..10_500).contains(&count), "{counts:?}");
        }
        assert_eq!(rng.below(1), 0);
    }

    #[test]
    fn permutation_is_deterministic_and_complete() {
        let a = permutation(100, 3);
        assert_eq!(a, permutation(100, 3));
        assert_ne!(a, permutation(100, 4));
        assert_ne!(a, (0..100).collect::<Vec<_>>());
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert!(permutation(0, 1).is_empty());
        assert_eq!(permutation(1, 1), vec![0]);
    }
}
