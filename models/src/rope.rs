//! Rotary position embeddings in the half-split layout (Llama, Mistral, Qwen2, Phi-3): the tables
//! of a span of positions, and the rotation of queries and keys by them.

use burn::prelude::*;

use crate::modules::{DeviceKey, device_key, kept_per_thread};

/// The rotary embedding's tables: `cos` and `sin`, `[rows, t, d]`, each frequency twice (the
/// half-split layout) — one row for positions `start..start + t` shared by a batch, or one per
/// batch row for positions of their own (packed examples).
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor<3>,
    sin: Tensor<3>,
}

impl Rope {
    /// The tables of `inv_freq` for positions `start..start + t` on `device`: built once per
    /// thread for each span, frequencies and device, and kept (a block walk asks for them in
    /// every block, a run in every step).
    pub fn new(inv_freq: &[f32], start: usize, t: usize, device: &Device) -> Self {
        type Tables = Vec<((Vec<u32>, usize, usize, DeviceKey), Rope)>;
        thread_local! {
            static TABLES: std::cell::RefCell<Tables> =
                const { std::cell::RefCell::new(Vec::new()) };
        }
        let freq = inv_freq.iter().map(|f| f.to_bits()).collect();
        let key = (freq, start, t, device_key(device));
        kept_per_thread(&TABLES, key, || Self::build(inv_freq, start, t, device))
    }

    fn build(inv_freq: &[f32], start: usize, t: usize, device: &Device) -> Self {
        let half = inv_freq.len();
        let mut angles = Vec::with_capacity(t * 2 * half);
        for p in start..start + t {
            for _ in 0..2 {
                angles.extend(inv_freq.iter().map(|f| p as f32 * f));
            }
        }
        let angles = Tensor::<3>::from_data(TensorData::new(angles, [1, t, 2 * half]), device);
        Self {
            cos: angles.clone().cos(),
            sin: angles.sin(),
        }
    }

    /// The tables of `inv_freq` for each batch row's own `positions` (`[batch, t]`: packed
    /// examples, each from position 0), on the positions' device.
    pub fn at(inv_freq: &[f32], positions: Tensor<2, Int>) -> Self {
        let [b, t] = positions.dims();
        let device = positions.device();
        let twice = [inv_freq, inv_freq].concat();
        let d = twice.len();
        let freq = Tensor::<1>::from_data(TensorData::new(twice, [d]), &device).reshape([1, 1, d]);
        // The same f32 product as the shared tables' `p · f`.
        let angles =
            positions.float().reshape([b, t, 1]).expand([b, t, d]) * freq.expand([b, t, d]);
        Self {
            cos: angles.clone().cos(),
            sin: angles.sin(),
        }
    }

    /// `x` (`[b, heads, t, d]`) rotated: `x·cos + rotate_half(x)·sin`, with `rotate_half(x) =
    /// [-x₂, x₁]` for the halves x₁, x₂ of each head. Where the tables are narrower than a
    /// head (a partial rotary factor, Phi-3's), its first dimensions rotate and the rest pass.
    pub fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        let [b, h, t, d] = x.dims();
        let r = self.cos.dims()[2];
        if r < d {
            let rotated = self.apply(x.clone().slice([0..b, 0..h, 0..t, 0..r]));
            let kept = x.slice([0..b, 0..h, 0..t, r..d]);
            return Tensor::cat(vec![rotated, kept], 3);
        }
        let x1 = x.clone().slice([0..b, 0..h, 0..t, 0..d / 2]);
        let x2 = x.clone().slice([0..b, 0..h, 0..t, d / 2..d]);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        // The tables are f32; the activations may be bf16 or f16 (mixed precision).
        let dtype = x.dtype();
        let rows = self.cos.dims()[0];
        let cos = self.cos.clone().cast(dtype).reshape([rows, 1, t, d]);
        let sin = self.sin.clone().cast(dtype).reshape([rows, 1, t, d]);
        x * cos + rotated * sin
    }
}
