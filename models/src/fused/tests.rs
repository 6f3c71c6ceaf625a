//! The fused functions against the Burn ops they replace: forward and every gradient within
//! 1e-5 of the tensor's scale, on shapes that reach every edge of the kernels.
use super::*;
use burn::module::Param;
use burn::nn::{DropoutConfig, LayerNormConfig, RmsNormConfig};
use burn::tensor::{Gradients, TensorData};

/// Numbers in [-2, 2) from a fixed sequence (the tests repeat exactly).
pub(crate) fn numbers(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

pub(crate) fn leaf<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
    spread(shape, seed, 1.0, 0.0, device)
}

/// A leaf of `numbers·scale + shift`.
pub(crate) fn spread<const D: usize>(
    shape: [usize; D],
    seed: u64,
    scale: f32,
    shift: f32,
    device: &Device,
) -> Tensor<D> {
    let n = shape.iter().product();
    let v = numbers(n, seed)
        .into_iter()
        .map(|x| x * scale + shift)
        .collect();
    Tensor::<D>::from_data(TensorData::new(v, shape), device).require_grad()
}

pub(crate) fn values<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.to_data().try_to_vec::<f32>().unwrap()
}

/// `max|a - b| ≤ tol·max|b|`: the difference against the tensor's own scale.
pub(crate) fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
    let diff = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff <= tol * scale,
        "{what}: max difference {diff:e} against scale {scale:e}"
    );
    assert!(a.iter().all(|v| v.is_finite()), "{what}: not finite");
}

/// The output and the gradient of `Σ output·w` (w fixed, not all ones) for each input.
fn run<const D: usize, const E: usize>(
    inputs: &[Tensor<D>],
    f: impl Fn(Vec<Tensor<D>>) -> Tensor<E>,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let out = f(inputs.to_vec());
    let w = Tensor::<E>::from_data(
        TensorData::new(numbers(out.shape().num_elements(), 99), out.shape()),
        &out.device(),
    );
    let grads: Gradients = (out.clone() * w).sum().backward();
    let grads = inputs
        .iter()
        .map(|x| values(&x.grad(&grads).expect("a gradient")))
        .collect();
    (values(&out), grads)
}

fn assert_same<const D: usize, const E: usize>(
    what: &str,
    inputs: &[Tensor<D>],
    fused: impl Fn(Vec<Tensor<D>>) -> Tensor<E>,
    composed: impl Fn(Vec<Tensor<D>>) -> Tensor<E>,
) {
    let (y1, g1) = run(inputs, fused);
    let (y2, g2) = run(inputs, composed);
    assert_close(&format!("{what} forward"), &y1, &y2, 1e-5);
    for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
        assert_close(&format!("{what} gradient {i}"), a, b, 1e-5);
    }
}

#[test]
fn layer_norm_equals_burns_forward_and_backward() {
    let device = Device::flex().autodiff();
    for (rows, c, bias) in [
        (1, 1, true),
        (3, 7, false),
        (5, 33, true),
        (24 * 64, 128, false),
    ] {
        let mut norm = LayerNormConfig::new(c).with_bias(bias).init(&device);
        norm.gamma = Param::from_tensor(spread([c], 3, 0.5, 1.0, &device));
        if bias {
            norm.beta = Some(Param::from_tensor(spread([c], 4, 0.5, 0.0, &device)));
        }
        let x = leaf([rows, 2, c], 5, &device);
        let gamma = norm.gamma.val();
        let beta = norm.beta.as_ref().map(|b| b.val());
        let what = format!("LayerNorm rows {rows} × {c}, bias {bias}");
        let fused =
            |v: Vec<Tensor<3>>| layer_norm_fused(v[0].clone(), gamma.clone(), beta.clone(), 1e-5);
        let composed = |v: Vec<Tensor<3>>| norm.forward(v[0].clone());
        let (y1, g1) = run(std::slice::from_ref(&x), fused);
        let (y2, g2) = run(std::slice::from_ref(&x), composed);
        assert_close(&format!("{what} forward"), &y1, &y2, 1e-5);
        assert_close(&format!("{what} dx"), &g1[0], &g2[0], 1e-5);
        // dgamma, dbeta: gradients of the parameters themselves.
        let param_grads = |fused: bool| {
            let out = if fused {
                layer_norm_fused(x.clone(), gamma.clone(), beta.clone(), 1e-5)
            } else {
                norm.forward(x.clone())
            };
            let w = Tensor::<3>::from_data(
                TensorData::new(numbers(out.shape().num_elements(), 7), out.shape()),
                &device,
            );
            let grads = (out * w).sum().backward();
            let g = values(&norm.gamma.grad(&grads).unwrap());
            let b = norm.beta.as_ref().map(|b| values(&b.grad(&grads).unwrap()));
            (g, b)
        };
        let (fg, fb) = param_grads(true);
        let (cg, cb) = param_grads(false);
        assert_close(&format!("{what} dgamma"), &fg, &cg, 1e-5);
        if let (Some(fb), Some(cb)) = (fb, cb) {
            assert_close(&format!("{what} dbeta"), &fb, &cb, 1e-5);
        }
    }
}

#[test]
fn rms_norm_equals_burns_forward_and_backward() {
    let device = Device::flex().autodiff();
    // Widths below, at and past the eight partial sums, and the Llama recipe's (not one: a
    // row of one element normalises to ±1, whose gradient is rounding alone).
    for (rows, c) in [(1, 2), (3, 7), (5, 8), (4, 33), (12 * 64, 256)] {
        let mut norm = RmsNormConfig::new(c).init(&device);
        norm.gamma = Param::from_tensor(spread([c], 3, 0.5, 1.0, &device));
        let x = leaf([rows, 2, c], 5, &device);
        let what = format!("RMSNorm rows {rows} × {c}");
        let (y1, g1) = run(std::slice::from_ref(&x), |v| rms_norm(&norm, v[0].clone()));
        let (y2, g2) = run(std::slice::from_ref(&x), |v| norm.forward(v[0].clone()));
        assert_close(&format!("{what} forward"), &y1, &y2, 1e-5);
        assert_close(&format!("{what} dx"), &g1[0], &g2[0], 1e-5);
        let dgamma = |fused: bool| {
            let out = if fused {
                rms_norm(&norm, x.clone())
            } else {
                norm.forward(x.clone())
            };
            let w = Tensor::<3>::from_data(
                TensorData::new(numbers(out.shape().num_elements(), 7), out.shape()),
                &device,
            );
            values(&norm.gamma.grad(&(out * w).sum().backward()).unwrap())
        };
        assert_close(
            &format!("{what} dgamma"),
            &dgamma(true),
            &dgamma(false),
            1e-5,
        );
    }
}

#[test]
fn swiglu_equals_burns_forward_and_backward() {
    let device = Device::flex().autodiff();
    for shape in [[1, 1], [7, 13], [12 * 64, 688]] {
        // The gate spread to ±8 to reach both of the sigmoid's tails.
        let gate = spread(shape, 11, 4.0, 0.0, &device);
        let up = leaf(shape, 12, &device);
        assert_same(
            &format!("SwiGLU {shape:?}"),
            &[gate, up],
            |v| swiglu(v[0].clone(), v[1].clone()),
            |v| burn::tensor::activation::silu(v[0].clone()) * v[1].clone(),
        );
    }
}

#[test]
fn relu_max_pool_equals_burns_forward_and_backward() {
    let device = Device::flex().autodiff();
    let relu = Relu::new();
    let pool = burn::nn::pool::MaxPool2dConfig::new([2, 2]).init();
    // Odd sides (a row and a column left out) and the MNIST ConvNet's planes.
    for shape in [[1, 1, 2, 2], [2, 3, 5, 7], [64, 16, 28, 28]] {
        let x = leaf(shape, 13, &device);
        assert_same(
            &format!("ReLU + max-pool {shape:?}"),
            &[x],
            |v| relu_max_pool(&relu, &pool, v[0].clone()),
            |v| pool.forward(relu.forward(v[0].clone())),
        );
    }
}

#[test]
fn gelu_equals_burns_forward_and_backward() {
    let device = Device::flex().autodiff();
    for shape in [[1, 1], [7, 13], [64, 512]] {
        // Spread to ±6 to reach both tails.
        let x = spread(shape, 11, 3.0, 0.0, &device);
        assert_same(
            &format!("GELU {shape:?}"),
            &[x],
            |v| gelu(v[0].clone()),
            |v| burn::tensor::activation::gelu(v[0].clone()),
        );
    }
}

#[test]
fn cross_entropy_equals_burns_forward_and_backward() {
    let device = Device::flex().autodiff();
    let burns = |logits: Tensor<2>, targets: Tensor<1, Int>| {
        burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, targets)
    };
    for (n, v) in [(1, 2), (37, 65), (24 * 64, 97), (5, 50_257)] {
        let logits = spread([n, v], 21, 4.0, 0.0, &device);
        let ids: Vec<i64> = (0..n).map(|i| ((i * 7919 + 13) % v) as i64).collect();
        let targets = Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), &device);
        for (name, composed) in [
            ("Burn's loss", &burns as &dyn Fn(_, _) -> _),
            ("the composed ops", &cross_entropy_composed),
        ] {
            assert_same(
                &format!("cross-entropy {n} × {v} against {name}"),
                std::slice::from_ref(&logits),
                |x| cross_entropy(x[0].clone(), targets.clone()),
                |x| composed(x[0].clone(), targets.clone()),
            );
        }
    }
}

#[test]
fn cross_entropy_leaves_out_the_ignored_rows_and_gives_them_no_gradient() {
    let device = Device::flex().autodiff();
    let (n, v) = (37, 65);
    let ids: Vec<i64> = (0..n)
        .map(|i| {
            if i % 3 == 1 {
                crate::IGNORE
            } else {
                ((i * 7919 + 13) % v) as i64
            }
        })
        .collect();
    let kept: Vec<usize> = (0..n).filter(|i| i % 3 != 1).collect();
    let logits = spread([n, v], 21, 4.0, 0.0, &device);
    let targets = Tensor::<1, Int>::from_data(TensorData::new(ids.clone(), [n]), &device);
    // Both ways agree with each other ...
    assert_same(
        "cross-entropy with ignored rows",
        std::slice::from_ref(&logits),
        |x| cross_entropy(x[0].clone(), targets.clone()),
        |x| cross_entropy_composed(x[0].clone(), targets.clone()),
    );
    // ... and with Burn's loss over the kept rows alone.
    let (y, g) = run(std::slice::from_ref(&logits), |x| {
        cross_entropy(x[0].clone(), targets.clone())
    });
    let index = Tensor::<1, Int>::from_data(
        TensorData::new(kept.iter().map(|&i| i as i64).collect(), [kept.len()]),
        &device,
    );
    let kept_targets: Vec<i64> = kept.iter().map(|&i| ids[i]).collect();
    let kept_targets =
        Tensor::<1, Int>::from_data(TensorData::new(kept_targets, [kept.len()]), &device);
    let (y2, _) = run(std::slice::from_ref(&logits), |x| {
        burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&device)
            .forward(x[0].clone().select(0, index.clone()), kept_targets.clone())
    });
    assert_close("the mean over the kept rows", &y, &y2, 1e-6);
    for row in (0..n).filter(|i| i % 3 == 1) {
        assert!(
            g[0][row * v..(row + 1) * v].iter().all(|&d| d == 0.0),
            "row {row} is ignored but its logits have a gradient"
        );
    }
    assert!(g[0][..v].iter().any(|&d| d != 0.0), "a kept row's gradient");
    // Every row ignored: the loss 0 and no gradient, not NaN.
    let none = Tensor::<1, Int>::from_data(TensorData::new(vec![crate::IGNORE; n], [n]), &device);
    for (name, loss) in [
        ("fused", &cross_entropy as &dyn Fn(_, _) -> Tensor<1>),
        ("composed", &cross_entropy_composed),
    ] {
        let (y, g) = run(std::slice::from_ref(&logits), |x| {
            loss(x[0].clone(), none.clone())
        });
        assert_eq!(y, [0.0], "{name}: no row scored");
        assert!(g[0].iter().all(|&d| d == 0.0), "{name}: no row scored");
    }
}

#[test]
fn causal_attention_equals_burns_forward_and_backward() {
    let device = Device::flex().autodiff();
    let off = DropoutConfig::new(0.0).init();
    // T = 1 (only itself), T not a multiple of any tile, D odd, the GPT recipe's shape,
    // and T over three of the backward's key blocks of 64 (the last one partial).
    for [b, h, t, d] in [
        [1, 1, 1, 4],
        [2, 3, 5, 7],
        [2, 2, 37, 16],
        [24, 4, 64, 32],
        [1, 2, 150, 8],
    ] {
        let c = h * d;
        // q, k, v as the models make them: strided views of one [B, T, 3C] projection.
        let qkv = leaf([b, t, 3 * c], 31, &device);
        let split = |x: &Tensor<3>, i: usize| {
            x.clone()
                .slice([0..b, 0..t, i * c..(i + 1) * c])
                .reshape([b, t, h, d])
                .swap_dims(1, 2)
        };
        let what = format!("attention {:?}", [b, h, t, d]);
        assert_same(
            &what,
            std::slice::from_ref(&qkv),
            |x| attention_fused(split(&x[0], 0), split(&x[0], 1), split(&x[0], 2), None),
            |x| {
                causal_attention_composed(
                    split(&x[0], 0),
                    split(&x[0], 1),
                    split(&x[0], 2),
                    None,
                    Some(crate::draw::DropoutPart::whole(&off)),
                )
            },
        );
        // And contiguous inputs of their own.
        let (q, k, v) = (
            leaf([b, h, t, d], 41, &device),
            leaf([b, h, t, d], 42, &device),
            leaf([b, h, t, d], 43, &device),
        );
        assert_same(
            &format!("{what}, contiguous"),
            &[q, k, v],
            |x| attention_fused(x[0].clone(), x[1].clone(), x[2].clone(), None),
            |x| {
                causal_attention_composed(
                    x[0].clone(),
                    x[1].clone(),
                    x[2].clone(),
                    None,
                    Some(crate::draw::DropoutPart::whole(&off)),
                )
            },
        );
    }
}

#[test]
fn packed_attention_equals_burns_forward_and_backward() {
    let device = Device::flex().autodiff();
    for [b, h, t, d] in [
        [1, 1, 1, 4],
        [2, 3, 5, 7],
        [2, 2, 37, 16],
        [12, 4, 64, 32],
        [1, 2, 150, 8],
    ] {
        let qkv = leaf([b, t, 3 * h * d], 51, &device);
        assert_same(
            &format!("packed attention {:?}", [b, h, t, d]),
            std::slice::from_ref(&qkv),
            |x| causal_attention_packed(x[0].clone(), h, None),
            |x| packed_composed(x[0].clone(), h, None, None),
        );
        // A projection that is itself a view: the first 3·C of wider rows.
        let wide = leaf([b, t, 3 * h * d + 5], 52, &device);
        let view = |x: &Tensor<3>| x.clone().slice([0..b, 0..t, 0..3 * h * d]);
        assert_same(
            &format!("packed attention {:?}, strided", [b, h, t, d]),
            std::slice::from_ref(&wide),
            |x| causal_attention_packed(view(&x[0]), h, None),
            |x| packed_composed(view(&x[0]), h, None, None),
        );
    }
}

/// Each position's document start in rows packed with documents of `lengths` (one list per
/// row, summing to `t`), as a `[rows, t]` tensor.
fn document_starts(lengths: &[&[usize]], device: &Device) -> Tensor<2, Int> {
    let t: usize = lengths[0].iter().sum();
    let mut starts = Vec::new();
    for row in lengths {
        let mut at = 0;
        for &n in *row {
            starts.extend(std::iter::repeat_n(at as i64, n));
            at += n;
        }
        assert_eq!(at, t);
    }
    Tensor::from_data(TensorData::new(starts, [lengths.len(), t]), device)
}

#[test]
fn attention_within_documents_equals_the_masked_composition_and_each_document_alone() {
    let device = Device::flex().autodiff();
    let (h, d) = (2, 8);
    // Documents that straddle the kernel's blocks of 64 rows, one of a single token, a row
    // that is one document.
    let rows: [&[usize]; 3] = [&[40, 70, 40], &[1, 149], &[150]];
    let starts = document_starts(&rows, &device);
    let (b, t) = (rows.len(), 150);
    let qkv = leaf([b, t, 3 * h * d], 71, &device);
    let c = h * d;
    let split = |x: &Tensor<3>, i: usize| {
        x.clone()
            .slice([0..b, 0..t, i * c..(i + 1) * c])
            .reshape([b, t, h, d])
            .swap_dims(1, 2)
    };
    assert_same(
        "attention within documents",
        std::slice::from_ref(&qkv),
        |x| {
            attention_fused(
                split(&x[0], 0),
                split(&x[0], 1),
                split(&x[0], 2),
                Some(&starts),
            )
        },
        |x| {
            causal_attention_composed(
                split(&x[0], 0),
                split(&x[0], 1),
                split(&x[0], 2),
                Some(&starts),
                None,
            )
        },
    );
    assert_same(
        "packed attention within documents",
        std::slice::from_ref(&qkv),
        |x| packed_within(x[0].clone(), h, Some(&starts), None),
        |x| packed_composed(x[0].clone(), h, Some(&starts), None),
    );
    // Row 0's middle document alone gives the rows it gives packed.
    let packed = values(&packed_within(qkv.clone(), h, Some(&starts), None));
    let alone = qkv.clone().slice([0..1, 40..110, 0..3 * c]);
    let alone = values(&causal_attention_packed(alone, h, None));
    let inside: Vec<f32> = (40..110)
        .flat_map(|i| packed[i * c..(i + 1) * c].to_vec())
        .collect();
    assert_close("a document alone", &inside, &alone, 1e-6);
}

/// The output and the gradients of `x`, `w` and `b` of `Σ linear(x, w or wᵀ, b)·r`.
fn linear_run(
    x: &Tensor<2>,
    (w, transposed): (&Tensor<2>, bool),
    b: Option<&Tensor<1>>,
    f: impl Fn(Tensor<2>, Tensor<2>, Option<Tensor<1>>) -> Tensor<2>,
) -> Vec<Vec<f32>> {
    let weight = if transposed {
        w.clone().transpose()
    } else {
        w.clone()
    };
    let out = f(x.clone(), weight, b.cloned());
    let r = Tensor::<2>::from_data(
        TensorData::new(numbers(out.shape().num_elements(), 61), out.shape()),
        &out.device(),
    );
    let grads: Gradients = (out.clone() * r).sum().backward();
    let mut all = vec![
        values(&out),
        values(&x.grad(&grads).expect("dx")),
        values(&w.grad(&grads).expect("dw")),
    ];
    if let Some(b) = b {
        all.push(values(&b.grad(&grads).expect("db")));
    }
    all
}

#[test]
fn linear_equals_burns_forward_and_backward() {
    let device = Device::flex().autodiff();
    for (rows, k, n) in [(1, 1, 1), (7, 5, 3), (37, 33, 65), (12 * 64, 128, 384)] {
        let x = leaf([rows, k], 71, &device);
        let w = spread([k, n], 72, 0.1, 0.0, &device);
        // A weight stored the other way round, as a tied embedding's transpose is.
        let wt = spread([n, k], 73, 0.1, 0.0, &device);
        let b = spread([n], 74, 0.5, 0.0, &device);
        for (weight, layout) in [((&w, false), "row-major"), ((&wt, true), "transposed")] {
            for bias in [None, Some(&b)] {
                let what = format!(
                    "linear {rows} × {k} → {n}, {layout}, bias {}",
                    bias.is_some()
                );
                let fused = linear_run(&x, weight, bias, linear);
                let composed = linear_run(&x, weight, bias, burn::tensor::module::linear);
                for (i, (a, c)) in fused.iter().zip(&composed).enumerate() {
                    assert_close(&format!("{what}, output {i}"), a, c, 1e-5);
                }
            }
        }
    }
}

#[test]
fn a_seeded_root_gives_its_output_the_seed_as_gradient() {
    let device = Device::flex().autodiff();
    let output = leaf([3, 5, 7], 81, &device);
    let seed = Tensor::<3>::from_data(TensorData::new(numbers(105, 82), [3, 5, 7]), &device);
    let composed = (output.clone() * seed.clone()).sum();
    let root = dot_seed(output.clone() * 1.0, seed.clone());
    assert_close(
        "seeded root's value",
        &values(&root),
        &values(&composed),
        1e-5,
    );
    // Scaled after the root, the gradient scales with it.
    let grads: Gradients = (root * 3.0).backward();
    let want: Vec<f32> = values(&seed).iter().map(|v| v * 3.0).collect();
    assert_close(
        "the output's gradient",
        &values(&output.grad(&grads).expect("a gradient")),
        &want,
        1e-6,
    );
}

#[test]
fn without_autodiff_the_kernels_give_the_same_outputs() {
    let device = Device::flex();
    let x = Tensor::<2>::from_data(TensorData::new(numbers(6 * 40, 8), [6, 40]), &device);
    assert_close(
        "GELU",
        &values(&gelu(x.clone())),
        &values(&burn::tensor::activation::gelu(x.clone())),
        1e-5,
    );
    let norm = LayerNormConfig::new(40).init(&device);
    assert_close(
        "LayerNorm",
        &values(&layer_norm(&norm, 1e-5, x.clone())),
        &values(&norm.forward(x.clone())),
        1e-5,
    );
    let rms = RmsNormConfig::new(40).init(&device);
    assert_close(
        "RMSNorm",
        &values(&rms_norm(&rms, x.clone())),
        &values(&rms.forward(x.clone())),
        1e-5,
    );
    let up = x.clone().flip([0]);
    assert_close(
        "SwiGLU",
        &values(&swiglu(x.clone(), up.clone())),
        &values(&(burn::tensor::activation::silu(x.clone()) * up)),
        1e-5,
    );
    let q = x.clone().reshape([1, 2, 3, 40]);
    let off = DropoutConfig::new(0.0).init();
    assert_close(
        "attention",
        &values(&causal_attention(
            q.clone(),
            q.clone(),
            q.clone(),
            Some(crate::draw::DropoutPart::whole(&off)),
        )),
        &values(&causal_attention_composed(
            q.clone(),
            q.clone(),
            q,
            None,
            None,
        )),
        1e-5,
    );
    let qkv = x.clone().reshape([2, 4, 30]);
    assert_close(
        "packed attention",
        &values(&causal_attention_packed(qkv.clone(), 5, None)),
        &values(&packed_composed(qkv, 5, None, None)),
        1e-5,
    );
    let conv = burn::nn::conv::Conv2dConfig::new([2, 3], [3, 3])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init(&device);
    let image = x.clone().reshape([2, 2, 6, 10]);
    assert_close(
        "conv2d",
        &values(&conv2d(&conv, image.clone())),
        &values(&conv.forward(image)),
        1e-5,
    );
    let w = Tensor::<2>::from_data(TensorData::new(numbers(40 * 9, 9), [40, 9]), &device);
    let b = Tensor::<1>::from_data(TensorData::new(numbers(9, 10), [9]), &device);
    assert_close(
        "linear",
        &values(&linear(x.clone(), w.clone(), Some(b.clone()))),
        &values(&burn::tensor::module::linear(x, w, Some(b))),
        1e-5,
    );
}

#[test]
fn other_dtypes_and_live_dropout_take_burns_ops() {
    let device = Device::flex().autodiff();
    let x = leaf([4, 8], 1, &device);
    // bf16: the fused kernels take f32 only, so Burn's GELU runs (and gives bf16).
    let y = gelu(x.clone().cast(burn::tensor::FloatDType::BF16));
    assert_eq!(y.dtype(), DType::BF16);
    // Dropout that acts in training: the composed path, which draws the mask.
    let live = DropoutConfig::new(0.5).init();
    let q = leaf([1, 1, 4, 8], 2, &device);
    let live = crate::draw::DropoutPart::whole(&live);
    let a = causal_attention(q.clone(), q.clone(), q.clone(), Some(live));
    let b = attention_fused(q.clone(), q.clone(), q, None);
    assert_ne!(values(&a), values(&b), "dropout at 0.5 changed nothing");
}
