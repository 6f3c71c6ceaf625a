//! Dropout whose masks are a function of a key and their order in a forward, not of the
//! backend's shared random state: what lets ranks that wait for each other inside a forward
//! (a tensor-parallel group) draw the masks one device draws.
//!
//! A backend keeps one random state per process. The engine makes a forward's draws
//! reproducible by seeding that state from the forward's key and holding
//! [`with_rng`]'s lock for the whole forward — which a forward that runs collectives
//! with another rank of its process cannot do (the other rank would wait for the lock, this
//! one for the other rank). Under a key ([`keyed`]), [`dropout`] instead seeds the state for
//! each draw from (key, the draw's number in the forward) and holds the lock only for that
//! draw. It draws the mask of the whole tensor, of which a tensor-parallel rank computes a
//! part, and keeps the part: every rank of a group, and one device with the same key, then
//! apply the same masks to the same elements.
//!
//! A model whose every draw goes through here says so (`TensorParallel::tp_draws_keyed`); the
//! engine refuses a group to a model that draws otherwise.

use std::cell::Cell;

use burn::nn::Dropout;
use burn::prelude::*;
use burn::tensor::Distribution;

/// Runs `f` — typically seeding a device and building a model — while no other caller of
/// this function draws random numbers.
///
/// Burn's CPU random generator is process-wide, so two threads initialising models at once
/// (two runs in one process, replicas starting, tests in parallel) would interleave their
/// draws and make seeded initialisation irreproducible. Every model construction in kiln goes
/// through here. A thread that holds the lock already (a keyed draw, [`dropout`], inside a forward
/// that the engine runs under it) runs `f` as it is.
pub fn with_rng<R>(f: impl FnOnce() -> R) -> R {
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    thread_local! {
        static HELD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    struct Release;
    impl Drop for Release {
        fn drop(&mut self) {
            HELD.set(false);
        }
    }
    if HELD.get() {
        return f();
    }
    let _guard = RNG.lock().unwrap_or_else(|p| p.into_inner());
    HELD.set(true);
    // Dropped before the guard: the flag is down before the lock is free.
    let _release = Release;
    f()
}

thread_local! {
    /// The key of the running forward and how many draws it has made.
    static KEY: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
}

/// Runs `f`, one forward, with `key` as the key of its draws ([`dropout`]); the key before it
/// is restored afterwards, also when `f` panics.
pub fn keyed<R>(key: u64, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<(u64, u64)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            KEY.set(self.0);
        }
    }
    let _restore = Restore(KEY.replace(Some((key, 0))));
    f()
}

/// The seed of the next draw under the thread's key, if there is one.
fn next_seed() -> Option<u64> {
    let (key, n) = KEY.get()?;
    KEY.set(Some((key, n + 1)));
    Some(splitmix(splitmix(key) ^ n))
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The part of a whole tensor that a rank holds: the `index`-th of `of` equal parts along
/// dimension `dim` (a tensor-parallel rank's heads: `kiln_models::tp::part`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// The dimension the whole is cut along.
    pub dim: usize,
    /// Which part this is, from 0.
    pub index: usize,
    /// How many equal parts the whole is cut into.
    pub of: usize,
}

/// A dropout and the part of the whole tensor it is applied to (`None`: the whole), as the
/// fused attention takes it.
#[derive(Debug, Clone, Copy)]
pub struct DropoutPart<'a> {
    /// The dropout.
    pub dropout: &'a Dropout,
    /// The part of the whole that its input is.
    pub part: Option<Part>,
}

impl<'a> DropoutPart<'a> {
    /// `dropout` on its input as a whole.
    pub fn whole(dropout: &'a Dropout) -> Self {
        Self {
            dropout,
            part: None,
        }
    }

    /// [`dropout`] of `x` with this dropout and part.
    pub fn apply<const D: usize>(self, x: Tensor<D>) -> Tensor<D> {
        dropout(self.dropout, x, self.part)
    }
}

/// What a kernel needs to draw a dropout mask of its own, as a function of the seed and each
/// element's place: the draw's seed (the next under the thread's key, as [`dropout`] would
/// take it), the probability and the part of the whole its input is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelDraw {
    /// The seed of this draw.
    pub seed: u64,
    /// The probability of dropping an element.
    pub prob: f64,
    /// The part of the whole tensor the input is (`None`: the whole).
    pub part: Option<Part>,
}

/// Whether `dropout` does anything here: in training, on an autodiff device, at a probability
/// above 0 (as [`dropout`] decides).
pub fn acts(dropout: &Dropout, device: &Device) -> bool {
    dropout.training.is_enabled() && device.is_autodiff() && dropout.prob > 0.0
}

/// The next draw of the running forward for a kernel that draws its own mask, if the forward
/// is keyed ([`keyed`]); `None` otherwise (the caller then draws with [`dropout`]). Takes the
/// draw's number as [`dropout`] would, so the draws after it are the same either way.
pub fn kernel_draw(part: DropoutPart<'_>) -> Option<KernelDraw> {
    Some(KernelDraw {
        seed: next_seed()?,
        prob: part.dropout.prob,
        part: part.part,
    })
}

/// `dropout` applied to `x`, as Burn's [`Dropout::forward`] applies it (nothing outside
/// training or at probability 0; kept elements scaled by `1 / (1 - prob)`), with the mask
/// drawn for the whole tensor of which `x` is `part` (`None`: `x` is whole) and `x`'s part of
/// it kept. Under a key ([`keyed`]) the mask is a function of the key and the number of draws
/// before it; without one it comes from the backend's shared state. A keyed draw on a CubeCL
/// device hashes its mask in a kernel instead ([`crate::cube::dropout`]; a mask of its own,
/// not the backend's Bernoulli draw).
pub fn dropout<const D: usize>(dropout: &Dropout, x: Tensor<D>, part: Option<Part>) -> Tensor<D> {
    if !acts(dropout, &x.device()) {
        return x;
    }
    let seed = next_seed();
    if let Some(mask) = kernel_mask(&x, seed, dropout, part) {
        return crate::cube::dropout(x, mask);
    }
    drawn(dropout, x, part, seed)
}

/// `residual + dropout(dropout, x, part)` ([`dropout()`]), the same draw: where the draw hashes
/// its mask in a kernel and `residual` is `x`'s shape and type, the sum in the same kernel
/// ([`crate::cube::dropout_add`]), which Burn's fusion would leave a launch of its own.
pub fn dropout_add<const D: usize>(
    dropout: &Dropout,
    residual: Tensor<D>,
    x: Tensor<D>,
    part: Option<Part>,
) -> Tensor<D> {
    if !acts(dropout, &x.device()) {
        return residual + x;
    }
    let seed = next_seed();
    let alike = residual.dims() == x.dims() && residual.dtype() == x.dtype();
    if alike && let Some(mask) = kernel_mask(&x, seed, dropout, part) {
        return crate::cube::dropout_add(residual, x, mask);
    }
    residual + drawn(dropout, x, part, seed)
}

/// The mask a GPU kernel draws for `x` (`part` of the whole) with `seed`: where there is a seed
/// (a keyed forward) and [`crate::cube::dropout_takes`] `x`; `None` otherwise.
fn kernel_mask<const D: usize>(
    x: &Tensor<D>,
    seed: Option<u64>,
    dropout: &Dropout,
    part: Option<Part>,
) -> Option<crate::cube::DropoutMask> {
    let seed = seed.filter(|_| crate::cube::dropout_takes(x))?;
    let (prob, dims) = (dropout.prob as f32, x.dims());
    match part {
        None => crate::cube::DropoutMask::whole(seed, prob, &dims),
        Some(p) => crate::cube::DropoutMask::part(seed, prob, &dims, p.dim, p.index, p.of),
    }
}

/// [`dropout()`]'s Bernoulli draw from the backend: seeded with `seed` where there is one.
fn drawn<const D: usize>(
    dropout: &Dropout,
    x: Tensor<D>,
    part: Option<Part>,
    seed: Option<u64>,
) -> Tensor<D> {
    let device = x.device();
    let keep = 1.0 - dropout.prob;
    let mut shape = x.dims();
    if let Some(p) = part {
        shape[p.dim] *= p.of;
    }
    let draw = || Tensor::<D>::random(shape, Distribution::Bernoulli(keep), &device);
    let mask = match seed {
        Some(seed) => with_rng(|| {
            device.seed(seed);
            draw()
        }),
        None => draw(),
    };
    let mask = match part {
        Some(p) => {
            let len = shape[p.dim] / p.of;
            mask.narrow(p.dim, p.index * len, len)
        }
        None => mask,
    };
    let dtype = x.dtype();
    x * mask.cast(dtype) * (1.0 / keep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::DropoutConfig;

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    }

    #[test]
    fn a_keyed_mask_is_the_keys_and_a_part_is_the_wholes() {
        let device = Device::flex().autodiff();
        let d = DropoutConfig::new(0.5).init();
        let x = Tensor::<3>::ones([2, 4, 8], &device);
        let whole = |key| keyed(key, || values(dropout(&d, x.clone(), None)));
        let (a, b) = (whole(7), whole(7));
        assert_eq!(a, b, "the same key draws the same mask");
        assert_ne!(a, whole(8), "another key draws another mask");
        assert!(a.iter().all(|&v| v == 0.0 || v == 2.0));
        assert!(a.contains(&0.0) && a.contains(&2.0));
        // The second draw of a forward differs from its first.
        let (first, second) = keyed(7, || {
            (
                values(dropout(&d, x.clone(), None)),
                values(dropout(&d, x.clone(), None)),
            )
        });
        assert_eq!(first, a);
        assert_ne!(first, second);
        // The two halves along dimension 1, each drawn as a part, are the whole's halves.
        let half = Tensor::<3>::ones([2, 2, 8], &device);
        for index in 0..2 {
            let part = Part {
                dim: 1,
                index,
                of: 2,
            };
            let got = keyed(7, || values(dropout(&d, half.clone(), Some(part))));
            let want = values(
                Tensor::<3>::from_data(TensorData::new(a.clone(), [2, 4, 8]), &device).narrow(
                    1,
                    2 * index,
                    2,
                ),
            );
            assert_eq!(got, want, "part {index}");
        }
        // Not training: nothing dropped.
        let plain = Tensor::<3>::ones([2, 4, 8], &Device::flex());
        assert_eq!(values(dropout(&d, plain.clone(), None)), values(plain));
    }
}
