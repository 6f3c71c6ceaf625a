//! What the unit tests of the by-parts paths (`linear.rs`, `norm.rs`) share: inputs from a
//! seed, a tensor's values, and their comparison with Burn's.

use burn::prelude::*;

/// `n` numbers in [-1, 1) from `seed`.
pub(super) fn numbers(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let x = (i ^ seed.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x85eb_ca6b);
            ((x >> 8) as f32 / (1u32 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `t`'s values.
pub(super) fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// Each of `a` within 1e-5 of `b`'s largest value of its twin in `b`, `b` not all zeros.
pub(super) fn assert_close(case: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{case}");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "{case}: all zeros");
    for (i, (p, q)) in a.iter().zip(b).enumerate() {
        assert!(
            (p - q).abs() <= 1e-5 * scale,
            "{case}, element {i}: {p} against Burn's {q}"
        );
    }
}
