//! What the fused kernels compute with, all `#[inline(always)]` so that each kernel's version
//! compiles them for its own instructions.
//!
//! `exp` and the normal distribution's CDF are polynomials here rather than libm calls, which a
//! vector loop cannot make: [`exp`] by range reduction to `[-ln2/2, ln2/2]` and a degree-7
//! Taylor polynomial (relative error under 2e-7), [`normal_cdf_pdf`] through
//! `erfc(z) = exp(-z²)·f(z)`, `f` a degree-10 polynomial in `1/(1 + z/2)` fitted for kiln by
//! weighted least squares on `[0, 10]` (relative error 3e-7 in f32). Reductions keep [`LANES`]
//! independent partial sums, so that the compiler vectorises them without reordering a sum.

/// Independent partial sums per reduction: 16 f32 = one AVX-512 register, two AVX2 ones.
const LANES: usize = 16;

const LOG2_E: f32 = std::f32::consts::LOG2_E;
const LN_2_HI: f32 = 0.693_145_75;
const LN_2_LO: f32 = 1.428_606_8e-6;
/// 1.5·2^23: adding and subtracting it rounds an f32 of magnitude below 2^22 to an integer.
const ROUND: f32 = 12_582_912.0;

/// `e^x` for `x` in f32's range (below -87.3 it returns about 1e-38 rather than 0; callers
/// subtract a maximum first, so such terms are negligible beside the 1 the maximum gives).
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.3);
    // `shifted`'s low mantissa bits hold k = round(x·log2 e) as an integer: 2^k is made from
    // them with integer vector ops (a float-to-int cast would be scalarised, being saturating).
    let shifted = x * LOG2_E + ROUND;
    let k = shifted - ROUND;
    let r = x - k * LN_2_HI - k * LN_2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let k_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    p * f32::from_bits(k_bits.wrapping_add(127) << 23)
}

/// Coefficients of `f(z) = erfc(z)·exp(z²) ≈ Σ c_i t^(i+1)`, `t = 1/(1 + z/2)`, `z ≥ 0`.
const ERFC_T: [f32; 10] = [
    2.820_691_2e-1,
    2.827_463e-1,
    2.397_606_8e-1,
    2.193_318_2e-1,
    -7.723_819e-2,
    3.758_852e-1,
    -6.078_15e-1,
    3.764_129_3e-1,
    -9.838_781e-2,
    7.234_882_5e-3,
];
const INV_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π).
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// The standard normal distribution's CDF Φ(x) and density φ(x), which share `exp(-x²/2)`.
#[inline(always)]
pub(super) fn normal_cdf_pdf(x: f32) -> (f32, f32) {
    let z = x.abs() * INV_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut f = 0.0;
    for c in ERFC_T.iter().rev() {
        f = (f + c) * t;
    }
    let e = exp(-0.5 * x * x);
    // Φ(-|x|) = erfc(|x|/√2)/2.
    let tail = 0.5 * e * f;
    let cdf = if x >= 0.0 { 1.0 - tail } else { tail };
    (cdf, e * INV_SQRT_2PI)
}

#[inline(always)]
pub(super) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
pub(super) fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for c in chunks {
        for l in 0..LANES {
            acc[l] = acc[l].max(c[l]);
        }
    }
    acc.iter().fold(tail, |m, &v| m.max(v))
}

/// `exp(x - m)` in place; returns the sum.
#[inline(always)]
pub(super) fn exp_shifted(x: &mut [f32], m: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp(*v - m);
    }
    sum(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_2e7_of_std_over_the_range_softmax_uses() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2e-7, "worst relative error {worst:e}");
    }

    #[test]
    fn the_normal_cdf_and_pdf_are_within_5e6_relative_down_to_the_far_tail() {
        // Φ(x) = erfc(-x/√2)/2 with an f64 erfc of its own, independent of the f32 fit: a
        // Maclaurin series below 3, a continued fraction above, erfc(-z) = 2 - erfc(z).
        fn erfc64(z: f64) -> f64 {
            if z < 0.0 {
                2.0 - erfc64(-z)
            } else if z < 3.0 {
                // erf by its Maclaurin series, converges fast for |z| < 3 in f64.
                let mut term = z;
                let mut total = z;
                let mut n = 0.0;
                loop {
                    n += 1.0;
                    term *= -z * z / n;
                    let add = term / (2.0 * n + 1.0);
                    total += add;
                    if add.abs() <= 1e-17 * total.abs() || n > 300.0 {
                        break;
                    }
                }
                1.0 - total * 2.0 / std::f64::consts::PI.sqrt()
            } else {
                // Continued fraction (Lentz) for z ≥ 3.
                let mut f = 0.0;
                for k in (1..200).rev() {
                    f = (k as f64 / 2.0) / (z + f);
                }
                (-z * z).exp() / std::f64::consts::PI.sqrt() / (z + f)
            }
        }
        let mut worst = (0.0f64, 0.0f64);
        for i in 0..=20_000 {
            // The reference at the f32 input itself.
            let x = (-10.0 + 20.0 * i as f64 / 20_000.0) as f32 as f64;
            let want_cdf = 0.5 * erfc64(-x / std::f64::consts::SQRT_2);
            let want_pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let (cdf, pdf) = normal_cdf_pdf(x as f32);
            let e_cdf = ((cdf as f64 - want_cdf) / want_cdf).abs();
            let e_pdf = ((pdf as f64 - want_pdf) / want_pdf).abs();
            worst = (worst.0.max(e_cdf), worst.1.max(e_pdf));
        }
        // |x| ≤ 10: exp(-x²/2) of an f32 x²/2 near 50 carries 50·6e-8 ≈ 3e-6 of its own
        // (GELU there is x or 0 to f32's precision).
        assert!(
            worst.0 < 5e-6 && worst.1 < 5e-6,
            "worst relative errors {worst:?}"
        );
    }
}
