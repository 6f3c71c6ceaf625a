//! The random numbers a model draws in its forward pass (dropout), made a function of
//! (seed, rank, step, forward) so that a run resumes bit for bit and in-process devices do not
//! race for them.
//!
//! A backend keeps one random state per process (Flex's and cubecl's alike), not one per
//! device: the ranks of one process would take turns on it in whatever order their threads
//! run, and nothing saves it in a checkpoint. So each forward of a model that draws seeds that
//! state from its own key, under kiln-models' random-number lock, and runs while holding it:
//! the forwards of a process's ranks then run one at a time (their backwards still run side by
//! side). Whether a model draws at all is measured once at start ([`model_draws`]); a model
//! that does not pays nothing.
//!
//! A forward that holds the lock cannot wait for another rank of its process. The walk's
//! collectives (ZeRO-3's gathers, the pipeline's sends) run between its forwards — each block's
//! its own —, outside the lock; a block cut around a synchronised BatchNorm runs unseeded (a
//! model with one draws nothing). A tensor-parallel group's forward waits for its group at
//! every block; it runs without the lock ([`begin`] with `tp` above 1), which only a model whose
//! draws are all keyed ([`kiln_models::draw`]: each draw seeded from the forward's key under
//! the lock for that draw alone) may, and the start-up check asks.
//!
//! A forward run again — a block or the stem recomputed in the backward — takes the seed its
//! first run took ([`Draw`], [`run`]): it draws the same masks, so recomputation gives the
//! gradients of the forward that ran, dropout or not.
//!
//! Either way the forward's key is also [`kiln_models::draw`]'s, so a keyed model draws the
//! same masks with or without the lock: a tensor-parallel rank, whose `rank` here is its data
//! rank (the group's), draws what one device with that rank draws.

use std::cell::RefCell;

use burn::prelude::*;
use burn::tensor::Distribution;
use kiln_datasets::rng::SplitMix64;

/// The key of the forwards of one rank's optimizer step, how many have run, and the device
/// whose backend they seed.
struct Stream {
    key: u64,
    next: u64,
    device: Device,
    locked: bool,
}

thread_local! {
    static STREAM: RefCell<Option<Stream>> = const { RefCell::new(None) };
}

fn mix(parts: &[u64]) -> u64 {
    parts.iter().fold(0x6b69_6c6e_u64, |acc, &p| {
        SplitMix64::new(acc ^ p).next_u64()
    })
}

/// From here on, each forward on this thread ([`forward`]) draws on `device` from its own
/// seed: a function of `seed`, the data rank of `rank` in tensor-parallel groups of `tp`
/// (`rank / tp`: a group's ranks draw alike), optimizer step `step`, parameter group `phase`
/// and the forward's number since this call. Without a group (`tp` 1) each forward holds the
/// process's random-number lock (any model); in one only its keyed draws do, since its
/// forwards wait for each other.
pub fn begin(seed: u64, rank: usize, tp: usize, step: usize, phase: usize, device: &Device) {
    let tp = tp.max(1);
    let key = mix(&[seed, (rank / tp) as u64, step as u64, phase as u64]);
    let locked = tp == 1;
    STREAM.set(Some(Stream {
        key,
        next: 0,
        device: device.clone(),
        locked,
    }));
}

/// Forwards on this thread draw from the backend's shared state again.
pub fn end() {
    STREAM.set(None);
}

/// One forward's seed, taken when it first runs ([`next`]) and given again to run it with
/// the same draws ([`run`]): a block recomputed in the backward draws the masks its forward
/// drew. None without a stream.
#[derive(Debug, Clone, Copy, Default)]
pub struct Draw(Option<u64>);

/// The next forward's seed from the thread's stream ([`begin`]), counted as one forward.
pub fn next() -> Draw {
    Draw(STREAM.with_borrow_mut(|stream| {
        stream.as_mut().map(|s| {
            s.next += 1;
            mix(&[s.key, s.next - 1])
        })
    }))
}

/// Runs `f`, one forward of a model (or of a part of it), with `draw`'s seed when it has one
/// and a stream is set: as the forward's key for keyed draws and, locked, seeding the backend
/// while holding the process's random-number lock (`f` must then not wait for another rank).
/// As it is otherwise.
pub fn run<R>(draw: Draw, f: impl FnOnce() -> R) -> R {
    let place = STREAM.with_borrow(|stream| stream.as_ref().map(|s| (s.device.clone(), s.locked)));
    let (Some(seed), Some((device, locked))) = (draw.0, place) else {
        return f();
    };
    if !locked {
        return kiln_models::draw::keyed(seed, f);
    }
    kiln_models::with_rng(|| {
        device.seed(seed);
        kiln_models::draw::keyed(seed, f)
    })
}

/// Runs `f`, the next forward ([`next`], then [`run`]).
pub fn forward<R>(f: impl FnOnce() -> R) -> R {
    run(next(), f)
}

/// Whether `forwards` draws random numbers on `device`: the backend's state after it differs
/// from the state the same seed gives without it. Each closure runs one forward.
pub fn model_draws(device: &Device, forwards: &mut dyn FnMut()) -> bool {
    const PROBE: u64 = 0x6b69_6c6e_7072_6f62;
    let sample = || {
        Tensor::<1>::random([4], Distribution::Default, device)
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap_or_default()
    };
    kiln_models::with_rng(|| {
        device.seed(PROBE);
        let untouched = sample();
        device.seed(PROBE);
        forwards();
        sample() != untouched
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forward_draws_from_its_key_and_nothing_else() {
        let device = Device::flex();
        let draw = || {
            forward(|| {
                Tensor::<1>::random([3], Distribution::Default, &device)
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .unwrap()
            })
        };
        begin(7, 1, 1, 5, 0, &device);
        let (first, second) = (draw(), draw());
        assert_ne!(first, second, "two forwards of a step draw differently");
        // Other draws in between (another rank's) change nothing.
        let _ = Tensor::<1>::random([9], Distribution::Default, &device).into_data();
        begin(7, 1, 1, 5, 0, &device);
        assert_eq!(draw(), first);
        assert_eq!(draw(), second);
        begin(7, 0, 1, 5, 0, &device);
        assert_ne!(draw(), first, "another rank draws differently");
        end();
        assert!(model_draws(&device, &mut || {
            let _ = Tensor::<1>::random([2], Distribution::Default, &device).into_data();
        }));
        assert!(!model_draws(&device, &mut || {
            let _ = Tensor::<1>::zeros([2], &device).into_data();
        }));
    }

    #[test]
    fn a_forward_run_again_draws_what_it_drew() {
        let device = Device::flex();
        let draw = || {
            Tensor::<1>::random([3], Distribution::Default, &device)
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .unwrap()
        };
        begin(7, 0, 1, 5, 0, &device);
        let first = next();
        let drawn = run(first, draw);
        let after = forward(draw);
        assert_ne!(drawn, after);
        assert_eq!(run(first, draw), drawn, "run again with its draw");
        // Running one again takes no number: the forward after it draws as before.
        begin(7, 0, 1, 5, 0, &device);
        let _ = forward(draw);
        assert_eq!(forward(draw), after);
        end();
    }

    #[test]
    fn keyed_draws_are_the_same_with_and_without_the_lock() {
        let device = Device::flex().autodiff();
        let d = burn::nn::DropoutConfig::new(0.5).init();
        let x = Tensor::<2>::ones([4, 8], &device);
        let run = |tp| {
            begin(3, 0, tp, 2, 0, &device);
            let masks: Vec<Vec<f32>> = (0..2)
                .map(|_| {
                    forward(|| kiln_models::draw::dropout(&d, x.clone(), None))
                        .into_data()
                        .convert::<f32>()
                        .try_into_vec::<f32>()
                        .unwrap()
                })
                .collect();
            end();
            masks
        };
        let locked = run(1);
        assert_ne!(locked[0], locked[1], "two forwards draw two masks");
        assert_eq!(locked, run(2), "rank 0 of a group of 2");
    }
}
