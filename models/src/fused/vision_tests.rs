//! The image kernels ([`super::vision`]) against the Burn ops they replace: forward, every
//! gradient and BatchNorm's running statistics within 1e-5 of the tensor's scale.
use super::tests::{assert_close, leaf, numbers, spread, values};
use super::*;
use burn::module::Param;
use burn::tensor::{Gradients, TensorData};

/// The output and the gradients of `x`, `weight` and `bias` of `Σ f(conv, x)·r`.
fn conv_run(
    conv: &Conv2d,
    x: &Tensor<4>,
    f: impl Fn(&Conv2d, Tensor<4>) -> Tensor<4>,
) -> Vec<Vec<f32>> {
    let out = f(conv, x.clone());
    let r = Tensor::<4>::from_data(
        TensorData::new(numbers(out.shape().num_elements(), 51), out.shape()),
        &out.device(),
    );
    let grads: Gradients = (out.clone() * r).sum().backward();
    let mut all = vec![
        values(&out),
        values(&x.grad(&grads).expect("dx")),
        values(&conv.weight.val().grad(&grads).expect("dw")),
    ];
    if let Some(b) = &conv.bias {
        all.push(values(&b.val().grad(&grads).expect("db")));
    }
    all
}

#[test]
fn conv2d_equals_burns_forward_and_backward() {
    use burn::nn::conv::Conv2dConfig;
    let device = Device::flex().autodiff();
    // [B, C, H, W], out channels, kernel, padding (top, left), bias: one pixel; no padding;
    // an oblong kernel; padding wider than the kernel's half; the MNIST ConvNet's first layer.
    let cases = [
        ([1, 1, 1, 1], 1, [1, 1], [0, 0], true),
        ([2, 3, 5, 7], 4, [3, 3], [0, 0], false),
        ([2, 3, 6, 5], 2, [5, 3], [2, 1], true),
        ([1, 2, 4, 4], 3, [3, 3], [2, 2], true),
        ([8, 1, 28, 28], 16, [5, 5], [2, 2], true),
        // Unfolded by rows (`conv_rows.rs`: C·kw ≥ 32): an oblong kernel, no bias, and the
        // ConvNet's second layer.
        ([2, 12, 6, 5], 4, [3, 5], [1, 2], false),
        ([2, 16, 5, 4], 3, [4, 2], [3, 0], true),
        ([8, 16, 14, 14], 32, [5, 5], [2, 2], true),
    ];
    for (shape, out, kernel, [ph, pw], bias) in cases {
        let conv = Conv2dConfig::new([shape[1], out], kernel)
            .with_padding(PaddingConfig2d::Explicit(ph, pw, ph, pw))
            .with_bias(bias)
            .init(&device);
        let x = leaf(shape, 41, &device);
        let what = format!("conv2d {shape:?} → {out}, kernel {kernel:?}, padding {ph}, {pw}");
        let fused = conv_run(&conv, &x, conv2d);
        let composed = conv_run(&conv, &x, |c, x| c.forward(x));
        for (i, (a, b)) in fused.iter().zip(&composed).enumerate() {
            assert_close(&format!("{what}, output {i}"), a, b, 1e-5);
        }
    }
}

#[test]
fn batch_norm_equals_burns_forward_backward_and_running_statistics() {
    let device = Device::flex().autodiff();
    // (Two values per channel would normalise to ±1 whatever they are: a gradient of rounding
    // noise alone.)
    for shape in [[2, 1, 1, 3], [3, 2, 5, 7], [32, 16, 28, 28]] {
        let c = shape[1];
        let make = || {
            let mut norm = burn::nn::BatchNormConfig::new(c).init(&device);
            norm.gamma = Param::from_tensor(spread([c], 31, 0.5, 1.0, &device));
            norm.beta = Param::from_tensor(spread([c], 32, 0.5, 0.0, &device));
            norm
        };
        // Off-centre input, so that a one-pass variance would lose digits.
        let x = spread(shape, 33, 1.0, 3.0, &device);
        let runs = [(make(), true), (make(), false)].map(|(norm, fused)| {
            let out = if fused {
                batch_norm(&norm, x.clone())
            } else {
                norm.forward(x.clone())
            };
            let r = Tensor::<4>::from_data(
                TensorData::new(numbers(out.shape().num_elements(), 34), out.shape()),
                &device,
            );
            let grads: Gradients = (out.clone() * r).sum().backward();
            [
                values(&out),
                values(&x.grad(&grads).expect("dx")),
                values(&norm.gamma.val().grad(&grads).expect("dgamma")),
                values(&norm.beta.val().grad(&grads).expect("dbeta")),
                values(&norm.running_mean.value()),
                values(&norm.running_var.value()),
            ]
        });
        for (i, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
            assert_close(&format!("BatchNorm {shape:?}, output {i}"), a, b, 1e-5);
        }
    }
}

#[test]
fn batch_norm_with_given_statistics_equals_burns_ops_in_all_five_inputs() {
    let device = Device::flex().autodiff();
    for shape in [[2, 1, 1, 3], [3, 4, 5, 7]] {
        let c = shape[1];
        let x = spread(shape, 21, 1.0, 2.0, &device);
        let stats = [
            spread([c], 22, 0.5, 1.0, &device),
            spread([c], 23, 0.5, 0.0, &device),
            spread([c], 24, 0.5, 2.0, &device),
            spread([c], 25, 0.2, 1.0, &device),
        ];
        let eps = 1e-5;
        let run = |fused: bool| {
            let y = if fused {
                batch_norm_with(x.clone(), stats.clone(), eps)
            } else {
                let [gamma, beta, mean, var] = stats.clone();
                let scale = var.add_scalar(eps).sqrt().recip().mul(gamma);
                (x.clone() - along_channels(mean)) * along_channels(scale) + along_channels(beta)
            };
            let r = Tensor::<4>::from_data(
                TensorData::new(numbers(y.shape().num_elements(), 26), y.shape()),
                &device,
            );
            let grads: Gradients = (y.clone() * r).sum().backward();
            let mut all = vec![values(&y), values(&x.grad(&grads).expect("dx"))];
            all.extend(
                stats
                    .iter()
                    .map(|t| values(&t.grad(&grads).expect("a gradient"))),
            );
            all
        };
        let (fused, composed) = (run(true), run(false));
        for (i, (a, b)) in fused.iter().zip(&composed).enumerate() {
            assert_close(
                &format!("BatchNorm with statistics {shape:?}, output {i}"),
                a,
                b,
                1e-5,
            );
        }
    }
}

#[test]
fn channel_sums_equal_burns_sums_with_and_without_a_centre() {
    let device = Device::flex();
    let x = spread([3, 4, 5, 7], 27, 1.0, 3.0, &Device::flex().autodiff());
    let center = [1.0f32, -2.0, 0.5, 3.0];
    for (centre, squared) in [
        (None, false),
        (Some(&center[..]), false),
        (Some(&center[..]), true),
    ] {
        let got = channel_sums(&x, centre, squared);
        let shift = Tensor::<1>::from_data(
            TensorData::new(centre.map_or(vec![0.0; 4], <[f32]>::to_vec), [4]),
            &device,
        );
        let plain = Tensor::<4>::from_data(x.to_data(), &device) - along_channels(shift);
        let values_in = if squared {
            plain.clone() * plain
        } else {
            plain
        };
        let want = values(
            &values_in
                .swap_dims(0, 1)
                .reshape([4, 105])
                .sum_dim(1)
                .reshape([4]),
        );
        assert_close(
            &format!("channel sums {centre:?} squared {squared}"),
            &got,
            &want,
            1e-5,
        );
    }
}
