//! What the GPU kernels' tests share, on WGPU (`wgpu`) and on CubeCL's CPU runtime
//! (`cube_cpu`): the switch that turns the kernels off, inputs from a seed, and the embedding
//! and attention computed by the kernels or by Burn's ops, in a float type of the test's.

use burn::prelude::*;
use burn::tensor::{DType, FloatDType};

/// Held by a test while it turns the GPU kernels off and on (the switch is the process's).
pub(crate) static SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Only `kernels` of the GPU's paths on while it lives (none: Burn's ops throughout), all on
/// again when it goes (a failing test included).
pub(crate) struct KernelsOnly;

impl KernelsOnly {
    pub(crate) fn new(kernels: &[kiln_models::cube::GpuKernel]) -> Self {
        kiln_models::cube::set_kernels(kernels);
        Self
    }

    /// Every kernel on but `off`, until dropped.
    pub(crate) fn all_but(off: kiln_models::cube::GpuKernel) -> Self {
        let on: Vec<_> = kiln_models::cube::GpuKernel::ALL
            .into_iter()
            .filter(|k| *k != off)
            .collect();
        Self::new(&on)
    }
}

impl Drop for KernelsOnly {
    fn drop(&mut self) {
        kiln_models::cube::set_enabled(true);
    }
}

/// Values in [-1, 1) from a seed, the same on every device.
pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The float types of a kernel test's tensors: the inputs' values rounded to `round` (so that
/// every way of computing is given the same numbers) and held in `compute`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Floats {
    pub(crate) round: DType,
    pub(crate) compute: DType,
}

/// f32 throughout.
pub(crate) const F32: Floats = Floats {
    round: DType::F32,
    compute: DType::F32,
};

/// `values(n, seed)` as a `dims` tensor on `device`, rounded and held as `kinds` says.
fn input<const D: usize>(seed: u64, dims: [usize; D], device: &Device, kinds: Floats) -> Tensor<D> {
    let n = dims.iter().product();
    let data = TensorData::new(values(n, seed), dims)
        .convert_dtype(kinds.round)
        .convert_dtype(DType::F32);
    Tensor::<D>::from_data(data, device).cast(FloatDType::from(kinds.compute))
}

/// A tensor's values as f32.
pub(crate) fn floats(data: TensorData) -> Vec<f32> {
    data.convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// The embedding's lookup and its table's gradient through `upstream`, on `device`, the table
/// and the upstream gradient in `kinds`.
pub(crate) fn embedding_and_grad(
    device: &Device,
    (vocab, width): (usize, usize),
    tokens: &[i64],
    batch: usize,
    kinds: Floats,
) -> (Vec<f32>, Vec<f32>) {
    let device = device.clone().autodiff();
    let mut table = burn::nn::EmbeddingConfig::new(vocab, width).init(&device);
    table.weight = burn::module::Param::from_tensor(input(7, [vocab, width], &device, kinds));
    let t = tokens.len() / batch;
    let ids = Tensor::<2, Int>::from_data(TensorData::new(tokens.to_vec(), [batch, t]), &device);
    let y = kiln_models::cube::embedding(&table, ids);
    let upstream = input(11, [batch, t, width], &device, kinds);
    let grads = (y.clone() * upstream).sum().backward();
    let grad = table.weight.grad(&grads).expect("the table's gradient");
    // The lookup and the gradient come back in the table's type.
    assert_eq!((y.dtype(), grad.dtype()), (kinds.compute, kinds.compute));
    (floats(y.into_data()), floats(grad.into_data()))
}

/// The Linear's output and the gradients of its input, weight and bias through `upstream`, on
/// `device` in f32, by `kiln_models::cube::linear` (`[rows, in]` by `[in, out]`); `tied`: by
/// `cube::product` with a `[out, in]` table seen transposed, as a tied head's: the output and
/// the gradients of the input and the table (no bias).
pub(crate) fn linear_and_grads(
    device: &Device,
    (rows, inputs, outputs): (usize, usize, usize),
    tied: bool,
) -> Vec<Vec<f32>> {
    let device = device.clone().autodiff();
    let x = input(21, [rows, inputs], &device, F32).require_grad();
    let (w, b) = (
        input(22, [inputs, outputs], &device, F32).require_grad(),
        input(23, [outputs], &device, F32).require_grad(),
    );
    let table = input(24, [outputs, inputs], &device, F32).require_grad();
    let y = if tied {
        kiln_models::cube::product(x.clone(), table.clone().transpose())
    } else {
        kiln_models::cube::linear(x.clone(), w.clone(), Some(b.clone()))
    };
    let upstream = input(25, [rows, outputs], &device, F32);
    let grads = (y.clone() * upstream).sum().backward();
    let grad = |t: &Tensor<2>| floats(t.grad(&grads).expect("a gradient").into_data());
    let mut out = vec![floats(y.into_data()), grad(&x)];
    if tied {
        out.push(grad(&table));
    } else {
        out.push(grad(&w));
        out.push(floats(
            b.grad(&grads).expect("the bias's gradient").into_data(),
        ));
    }
    out
}

/// The exact GELU of a `[b, t, c]` tensor and its gradient under a weighted sum, through the
/// models' path (`fused::gelu`: on a GPU the kernels) or Burn's `gelu` (`burn`), every float
/// rounded and held as `kinds` says: the output and x's gradient.
pub(crate) fn gelu_and_grad(
    device: &Device,
    dims: [usize; 3],
    burn: bool,
    kinds: Floats,
) -> Vec<Vec<f32>> {
    let device = device.clone().autodiff();
    // Values about ±2, where the GELU bends.
    let x = (input(41, dims, &device, kinds) * 4.0).require_grad();
    let upstream = input(42, dims, &device, kinds);
    let y = if burn {
        burn::tensor::activation::gelu(x.clone())
    } else {
        kiln_models::fused::gelu(x.clone())
    };
    let grads = (y.clone() * upstream).sum().backward();
    vec![
        floats(y.into_data()),
        floats(x.grad(&grads).expect("x's gradient").into_data()),
    ]
}

/// The probability of the dropout cases.
pub(crate) const DROP: f64 = 0.25;

/// The mask the dropout kernel draws for the first draw of a forward keyed by [`KEY`] on a
/// `dims` tensor (`part` of the whole when given), at [`DROP`].
pub(crate) fn dropout_kernels_mask(
    dims: [usize; 3],
    part: Option<kiln_models::draw::Part>,
) -> kiln_models::cube::DropoutMask {
    use kiln_models::draw::{DropoutPart, kernel_draw, keyed};
    let dropout = burn::nn::DropoutConfig::new(DROP).init();
    let draw = keyed(KEY, || {
        kernel_draw(DropoutPart {
            dropout: &dropout,
            part,
        })
    });
    let seed = draw.expect("a keyed forward's draw").seed;
    let mask = match part {
        None => kiln_models::cube::DropoutMask::whole(seed, DROP as f32, &dims),
        Some(p) => {
            kiln_models::cube::DropoutMask::part(seed, DROP as f32, &dims, p.dim, p.index, p.of)
        }
    };
    mask.expect("a mask")
}

/// Dropout at [`DROP`] of a `dims` tensor (`part` of the whole when given), added to a
/// residual where `added`, and the gradients under a weighted sum, every float rounded and held
/// as `kinds` says: through the models' path in a forward keyed by [`KEY`] (`mask` `None`; on a
/// GPU the kernel), or as Burn's ops multiplying by `mask`'s kept elements and `1 / (1 − p)`.
/// The output, x's gradient and (`added`) the residual's.
pub(crate) fn dropout_and_grad(
    device: &Device,
    dims: [usize; 3],
    part: Option<kiln_models::draw::Part>,
    mask: Option<&kiln_models::cube::DropoutMask>,
    added: bool,
    kinds: Floats,
) -> Vec<Vec<f32>> {
    let device = device.clone().autodiff();
    let x = input(51, dims, &device, kinds).require_grad();
    let upstream = input(52, dims, &device, kinds);
    let residual = input(53, dims, &device, kinds).require_grad();
    let dropout = burn::nn::DropoutConfig::new(DROP).init();
    let y = match (mask, added) {
        (None, false) => {
            let f = || kiln_models::draw::dropout(&dropout, x.clone(), part);
            kiln_models::draw::keyed(KEY, f)
        }
        (None, true) => {
            let f = || kiln_models::draw::dropout_add(&dropout, residual.clone(), x.clone(), part);
            kiln_models::draw::keyed(KEY, f)
        }
        (Some(mask), _) => {
            let n = dims.iter().product();
            let kept = (0..n)
                .map(|e| if mask.keeps(e) { 1.0 } else { 0.0 })
                .collect();
            let kept = Tensor::<3>::from_data(TensorData::new::<f32, _>(kept, dims), &device);
            let y = x.clone() * kept.cast(FloatDType::from(kinds.compute)) * (1.0 / (1.0 - DROP));
            if added { residual.clone() + y } else { y }
        }
    };
    let grads = (y.clone() * upstream).sum().backward();
    let mut out = vec![
        floats(y.into_data()),
        floats(x.grad(&grads).expect("x's gradient").into_data()),
    ];
    if added {
        let grad = residual.grad(&grads).expect("the residual's gradient");
        out.push(floats(grad.into_data()));
    }
    out
}

/// A LayerNorm (with its shift) or an RMSNorm over `[b, t, c]` through the models' path
/// (`fused::layer_norm`/`rms_norm`: on a GPU Burn's ops forward and kiln's kernel backward) or
/// through Burn's module (`burn`), every float given rounded and held as `kinds` says: the
/// output and the gradients of x, γ (and β) under a weighted sum.
pub(crate) fn norm_and_grads(
    device: &Device,
    [b, t, c]: [usize; 3],
    rms: bool,
    burn: bool,
    kinds: Floats,
) -> Vec<Vec<f32>> {
    use burn::module::Param;
    let device = device.clone().autodiff();
    let x = input(31, [b, t, c], &device, kinds).require_grad();
    // γ about 1, rounded and held as `kinds` says.
    let about_one: Vec<f32> = values(c, 32).iter().map(|v| v + 1.0).collect();
    let gamma = TensorData::new(about_one, [c])
        .convert_dtype(kinds.round)
        .convert_dtype(DType::F32);
    let gamma = Tensor::<1>::from_data(gamma, &device).cast(FloatDType::from(kinds.compute));
    let gamma = Param::from_tensor(gamma);
    let beta = Param::from_tensor(input(33, [c], &device, kinds));
    let upstream = input(34, [b, t, c], &device, kinds);
    let (y, params) = if rms {
        let mut norm = burn::nn::RmsNormConfig::new(c).init(&device);
        norm.gamma = gamma;
        let y = if burn {
            norm.forward(x.clone())
        } else {
            kiln_models::fused::rms_norm(&norm, x.clone())
        };
        (y, vec![norm.gamma.val()])
    } else {
        let mut norm = burn::nn::LayerNormConfig::new(c).init(&device);
        norm.gamma = gamma;
        norm.beta = Some(beta);
        let y = if burn {
            norm.forward(x.clone())
        } else {
            kiln_models::fused::layer_norm(&norm, 1e-5, x.clone())
        };
        let beta = norm.beta.as_ref().expect("a shift").val();
        (y, vec![norm.gamma.val(), beta])
    };
    let grads = (y.clone() * upstream).sum().backward();
    let mut out = vec![
        floats(y.into_data()),
        floats(x.grad(&grads).expect("x's gradient").into_data()),
    ];
    for p in params {
        out.push(floats(
            p.grad(&grads).expect("a parameter's gradient").into_data(),
        ));
    }
    out
}

/// How [`attention_and_grads`] computes: the GPU's kernels through `fused::attention_within`
/// (a keyed forward's dropout when given), Burn's composed ops written out here (scores, mask,
/// softmax, the given dropout mask, the product), or the CPU's fused kernel.
#[derive(Clone, Copy)]
pub(crate) enum Way<'a> {
    Kernels(Option<(&'a burn::nn::Dropout, Option<kiln_models::draw::Part>)>),
    /// The kernels through the packed projection's attention (`fused::packed_within`, the
    /// GPT's), q, k and v put side by side first (query heads as many as key/value heads).
    Packed(Option<&'a burn::nn::Dropout>),
    Composed(Option<kiln_models::cube::AttentionDropout>),
    CpuFused,
}

/// The forward key of the dropout cases.
pub(crate) const KEY: u64 = 0x5EED;

/// Each position's first key in two batch rows of `t` positions: two documents in the first
/// (from 0 and from 20), three in the second (from 0, 9 and 41).
pub(crate) fn packed_starts(t: usize) -> Vec<i64> {
    (0..t)
        .map(|i| if i < 20 { 0 } else { 20 })
        .chain((0..t).map(|i| [0, 9, 41][usize::from(i >= 9) + usize::from(i >= 41)]))
        .collect()
}

/// The mask the kernels draw for `dropout` on `heads` local heads (`part` of the whole's, when
/// given) in a forward keyed by [`KEY`]: its first draw's seed — what the composed ops are
/// given to compare with.
pub(crate) fn kernels_mask(
    dropout: &burn::nn::Dropout,
    part: Option<kiln_models::draw::Part>,
    heads: usize,
) -> kiln_models::cube::AttentionDropout {
    use kiln_models::draw::{DropoutPart, kernel_draw, keyed};
    let seed = keyed(KEY, || kernel_draw(DropoutPart { dropout, part }))
        .expect("a keyed forward's draw")
        .seed;
    kiln_models::cube::AttentionDropout {
        seed,
        prob: dropout.prob as f32,
        first_head: part.map_or(0, |p| p.index * heads),
        heads: part.map_or(heads, |p| p.of * heads),
    }
}

/// Attention's output and the gradients of q, k and v through `upstream` on `device`, by
/// `way`: q `[b, h, t, d]`, k and v `[b, kv, t, d]`, each row's first key from `starts` when
/// given; the inputs and the upstream gradient in `kinds`.
pub(crate) fn attention_and_grads(
    device: &Device,
    [b, h, kv, t, d]: [usize; 5],
    starts: Option<&[i64]>,
    way: Way<'_>,
    kinds: Floats,
) -> [Vec<f32>; 4] {
    let device = device.clone().autodiff();
    let tensor = |dims: [usize; 4], seed: u64| input(seed, dims, &device, kinds).require_grad();
    let (q, k, v) = (
        tensor([b, h, t, d], 3),
        tensor([b, kv, t, d], 5),
        tensor([b, kv, t, d], 9),
    );
    let first = |bi: usize, i: usize| starts.map_or(0, |s| s[bi * t + i] as usize);
    let y = match way {
        Way::Kernels(dropout) => {
            let starts = starts
                .map(|s| Tensor::<2, Int>::from_data(TensorData::new(s.to_vec(), [b, t]), &device));
            assert!(
                kiln_models::cube::attention_takes(&q, &k, &v),
                "the kernels do not take {:?}",
                [b, h, kv, t, d]
            );
            let dropout =
                dropout.map(|(dropout, part)| kiln_models::draw::DropoutPart { dropout, part });
            kiln_models::draw::keyed(KEY, || {
                kiln_models::fused::attention_within(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    starts.as_ref(),
                    dropout,
                )
            })
        }
        Way::Packed(dropout) => {
            assert_eq!(
                h, kv,
                "a packed projection has as many key/value heads as query heads"
            );
            let side = |x: &Tensor<4>| x.clone().swap_dims(1, 2).reshape([b, t, h * d]);
            let qkv = Tensor::cat(vec![side(&q), side(&k), side(&v)], 2);
            let dropout = dropout.map(kiln_models::draw::DropoutPart::whole);
            kiln_models::draw::keyed(KEY, || {
                kiln_models::fused::packed_within(qkv, h, None, dropout)
            })
            .reshape([b, t, h, d])
            .swap_dims(1, 2)
        }
        Way::CpuFused => {
            let starts = starts
                .map(|s| Tensor::<2, Int>::from_data(TensorData::new(s.to_vec(), [b, t]), &device));
            kiln_models::fused::attention_within(
                q.clone(),
                k.clone(),
                v.clone(),
                starts.as_ref(),
                None,
            )
        }
        Way::Composed(drop) => {
            let repeat = |x: Tensor<4>| {
                x.reshape([b, kv, 1, t, d])
                    .expand([b, kv, h / kv, t, d])
                    .reshape([b, h, t, d])
            };
            let scores = q
                .clone()
                .matmul(repeat(k.clone()).swap_dims(2, 3))
                .mul_scalar(1.0 / (d as f64).sqrt());
            let hidden: Vec<bool> = (0..b * t * t)
                .map(|n| {
                    let (bi, i, j) = (n / (t * t), n / t % t, n % t);
                    j > i || j < first(bi, i)
                })
                .collect();
            let hidden =
                Tensor::<4, Bool>::from_data(TensorData::new(hidden, [b, 1, t, t]), &device);
            let mut weights = burn::tensor::activation::softmax(
                scores.mask_fill(hidden.expand([b, h, t, t]), f32::NEG_INFINITY),
                3,
            );
            if let Some(drop) = drop {
                let kept: Vec<f32> = (0..b * h * t * t)
                    .map(|n| {
                        let (bi, hi, i, j) = (n / (h * t * t), n / (t * t) % h, n / t % t, n % t);
                        f32::from(u8::from(drop.keeps(bi, hi, i, j)))
                    })
                    .collect();
                let kept = Tensor::<4>::from_data(TensorData::new(kept, [b, h, t, t]), &device)
                    .cast(FloatDType::from(kinds.compute));
                weights = weights * kept * (1.0 / (1.0 - f64::from(drop.prob)));
            }
            weights.matmul(repeat(v.clone()))
        }
    };
    let upstream = input(13, [b, h, t, d], &device, kinds);
    let grads = (y.clone() * upstream).sum().backward();
    let grad = |x: &Tensor<4>| {
        let g = x.grad(&grads).expect("a gradient");
        // Every gradient comes back in its input's type.
        assert_eq!(g.dtype(), kinds.compute);
        floats(g.into_data())
    };
    assert_eq!(y.dtype(), kinds.compute);
    [floats(y.into_data()), grad(&q), grad(&k), grad(&v)]
}

/// `kernel`'s output and gradients within `tolerance` times each of `other`'s tensor's largest
/// value; the largest difference found, in those units.
pub(crate) fn assert_attention_close(
    case: &str,
    kernel: &[Vec<f32>; 4],
    name: &str,
    other: &[Vec<f32>; 4],
    tolerance: f32,
) -> f32 {
    let which = ["output", "dq", "dk", "dv"];
    assert_all_close(case, &which, kernel, name, other, tolerance)
}

/// Each of `kernel`'s tensors (named by `which`) within `tolerance` times the largest value of
/// `other`'s tensor of that name, none all zeros; the largest difference found, in those units.
pub(crate) fn assert_all_close(
    case: &str,
    which: &[&str],
    kernel: &[Vec<f32>],
    name: &str,
    other: &[Vec<f32>],
    tolerance: f32,
) -> f32 {
    assert_eq!(
        (kernel.len(), other.len()),
        (which.len(), which.len()),
        "{case}: tensors against names"
    );
    let mut worst = 0f32;
    for (which, (a, b)) in which.iter().zip(kernel.iter().zip(other)) {
        assert_eq!(
            a.len(),
            b.len(),
            "{case} {which}: {} values against {name}'s {}",
            a.len(),
            b.len()
        );
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.0, "{case} {which}: all zeros");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tolerance * scale,
                "{case}: {which} element {i}: kernel {x}, {name} {y}"
            );
            worst = worst.max((x - y).abs() / scale);
        }
    }
    worst
}
