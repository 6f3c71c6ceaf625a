//! A column- then row-parallel pair on 2 and 4 ranks (threads, each with its group) against
//! the same two Linears on one device: the output, the input's gradient and every parameter's
//! gradient (each rank's part against the same part of the whole), within 1e-5 of their scale.

use std::sync::{Arc, Barrier, Mutex};

use burn::module::Param;
use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::TensorData;

use super::cut::leaf;
use super::*;
use crate::fused::tests::{assert_close, numbers, values};

/// The ranks of one process summing through shared memory: each writes its buffer into its
/// slot, and every rank adds the slots in rank order (the same bits on every rank).
struct Shared {
    rank: usize,
    size: usize,
    slots: Arc<Mutex<Vec<Vec<f32>>>>,
    barrier: Arc<Barrier>,
}

impl TpGroup for Shared {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), String> {
        self.slots.lock().unwrap()[self.rank] = data.to_vec();
        self.barrier.wait();
        {
            let slots = self.slots.lock().unwrap();
            if slots.iter().any(|s| s.len() != data.len()) {
                return Err("ranks reduced buffers of different lengths".into());
            }
            for (i, v) in data.iter_mut().enumerate() {
                *v = slots.iter().map(|s| s[i]).fold(0.0, |a, b| a + b);
            }
        }
        // Nobody writes the next round's slot before everyone has read this one.
        self.barrier.wait();
        Ok(())
    }
}

impl Shared {
    fn group(size: usize) -> Vec<Arc<dyn TpGroup>> {
        let slots = Arc::new(Mutex::new(vec![Vec::new(); size]));
        let barrier = Arc::new(Barrier::new(size));
        (0..size)
            .map(|rank| {
                Arc::new(Shared {
                    rank,
                    size,
                    slots: slots.clone(),
                    barrier: barrier.clone(),
                }) as Arc<dyn TpGroup>
            })
            .collect()
    }
}

const D_IN: usize = 8;
const HIDDEN: usize = 12;
const ROWS: usize = 5;

fn linear(d_in: usize, d_out: usize, seed: u64, device: &Device) -> Linear {
    let w = numbers(d_in * d_out, seed)
        .iter()
        .map(|v| v * 0.3)
        .collect();
    let b = numbers(d_out, seed + 1).iter().map(|v| v * 0.1).collect();
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [d_in, d_out]), device)),
        bias: Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(b, [d_out]),
            device,
        ))),
    }
}

/// What a step of the pair gives: the output, the input's gradient, and the gradients of the
/// first Linear's weight and bias and of the second's weight and bias (on a rank, its parts).
struct Seen {
    y: Vec<f32>,
    dx: Vec<f32>,
    params: [Vec<f32>; 4],
}

/// `sum(y · y · w)` of `y = second(gelu(first(x)))`: a loss whose gradient depends on `y`.
fn loss(y: Tensor<3>, device: &Device) -> Tensor<1> {
    let w = Tensor::<3>::from_data(
        TensorData::new(numbers(ROWS * 2 * D_IN, 9), [ROWS, 2, D_IN]),
        device,
    );
    (y.clone() * y * w).sum()
}

fn input(device: &Device) -> Tensor<3> {
    Tensor::<3>::from_data(
        TensorData::new(numbers(ROWS * 2 * D_IN, 3), [ROWS, 2, D_IN]),
        device,
    )
    .require_grad()
}

fn one_device() -> Seen {
    let device = Device::flex().autodiff();
    let (first, second) = (
        linear(D_IN, HIDDEN, 1, &device),
        linear(HIDDEN, D_IN, 5, &device),
    );
    let x = input(&device);
    let y = second.forward(burn::tensor::activation::gelu(first.forward(x.clone())));
    seen(&first, &second, &x, y, &device)
}

/// What the pair `first`, `second` gave: the output `y`, and after the loss's backward the
/// gradients of the input `x` and of the Linears' weights and biases.
fn seen(first: &Linear, second: &Linear, x: &Tensor<3>, y: Tensor<3>, device: &Device) -> Seen {
    let grads = loss(y.clone(), device).backward();
    let grad = |p: &Param<Tensor<2>>| values(&p.grad(&grads).expect("a gradient"));
    let grad1 = |p: &Param<Tensor<1>>| values(&p.grad(&grads).expect("a gradient"));
    Seen {
        y: values(&y),
        dx: values(&x.grad(&grads).expect("a gradient")),
        params: [
            grad(&first.weight),
            grad1(first.bias.as_ref().unwrap()),
            grad(&second.weight),
            grad1(second.bias.as_ref().unwrap()),
        ],
    }
}

/// Rank `rank`'s part of `full`, cut as a column- or row-parallel Linear.
fn part(full: Linear, rank: usize, size: usize, column: bool) -> Linear {
    let (weight, bias) = if column {
        (Split::columns(1), Split::first(1))
    } else {
        (Split::ROWS, Split::Whole)
    };
    Linear {
        weight: Param::from_tensor(leaf(
            part_of(full.weight.val(), weight, rank, size).unwrap(),
        )),
        bias: full
            .bias
            .map(|b| Param::from_tensor(leaf(part_of(b.val(), bias, rank, size).unwrap()))),
    }
}

fn tensor_parallel(size: usize) -> Vec<Seen> {
    let threads: Vec<_> = Shared::group(size)
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            std::thread::spawn(move || {
                let device = Device::flex().autodiff();
                let first = part(linear(D_IN, HIDDEN, 1, &device), rank, size, true);
                let second = part(linear(HIDDEN, D_IN, 5, &device), rank, size, false);
                let x = input(&device);
                with_group(Some(group), || {
                    assert_eq!(place(), (rank, size));
                    let h = burn::tensor::activation::gelu(column(&first, x.clone()));
                    let y = row(&second, h);
                    seen(&first, &second, &x, y, &device)
                })
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Columns `cols` of a row-major `[rows, width]` matrix.
fn columns(m: &[f32], width: usize, cols: std::ops::Range<usize>) -> Vec<f32> {
    m.chunks(width)
        .flat_map(|row| row[cols.clone()].to_vec())
        .collect()
}

#[test]
fn a_column_then_row_parallel_pair_gives_one_devices_output_and_gradients() {
    let whole = one_device();
    for size in [2, 4] {
        for (rank, seen) in tensor_parallel(size).iter().enumerate() {
            let at = |what: &str| format!("{what}, rank {rank} of {size}");
            assert_close(&at("output"), &seen.y, &whole.y, 1e-5);
            assert_close(&at("input's gradient"), &seen.dx, &whole.dx, 1e-5);
            let cols = split_range(HIDDEN, rank, size).unwrap();
            let part = |m: &[f32]| columns(m, HIDDEN, cols.clone());
            assert_close(
                &at("first weight"),
                &seen.params[0],
                &part(&whole.params[0]),
                1e-5,
            );
            assert_close(
                &at("first bias"),
                &seen.params[1],
                &whole.params[1][cols.clone()],
                1e-5,
            );
            let rows = &whole.params[2][cols.start * D_IN..cols.end * D_IN];
            assert_close(&at("second weight"), &seen.params[2], rows, 1e-5);
            assert_close(&at("second bias"), &seen.params[3], &whole.params[3], 1e-5);
        }
    }
}

#[test]
fn outside_a_group_the_collectives_are_the_identity_and_a_split_must_divide() {
    let device = Device::flex().autodiff();
    let x = input(&device);
    assert_eq!(place(), (0, 1));
    let y = reduce_from_group(copy_to_group(x.clone()));
    assert_eq!(values(&y), values(&x));
    let e = part_of(
        linear(D_IN, HIDDEN, 1, &device).weight.val(),
        Split::columns(1),
        0,
        5,
    )
    .unwrap_err();
    assert_eq!(
        e,
        "12 cannot be split into 5 equal parts (12 is not a multiple of 5)"
    );
    assert!(split_range(12, 4, 4).is_err());
}

#[test]
fn a_fused_projections_blocks_are_cut_each_and_put_back_whole() {
    let device = Device::flex();
    // Three blocks (q, k, v) of 4 columns: rank 1 of 2 holds columns 2..4 of each.
    let whole = Tensor::<2>::from_data(
        TensorData::new((0..24).map(|v| v as f32).collect::<Vec<_>>(), [2, 12]),
        &device,
    );
    let parts: Vec<Tensor<2>> = (0..2)
        .map(|r| part_of(whole.clone(), Split::columns(3), r, 2).unwrap())
        .collect();
    assert_eq!(
        values(&parts[1]),
        [
            2.0, 3.0, 6.0, 7.0, 10.0, 11.0, 14.0, 15.0, 18.0, 19.0, 22.0, 23.0
        ]
    );
    let back = whole_of(parts, Split::columns(3)).unwrap();
    assert_eq!(values(&back), values(&whole));
    let rows: Vec<Tensor<2>> = (0..2)
        .map(|r| part_of(whole.clone(), Split::ROWS, r, 2).unwrap())
        .collect();
    assert_eq!(
        values(&rows[0]),
        (0..12).map(|v| v as f32).collect::<Vec<_>>()
    );
    assert_eq!(
        values(&whole_of(rows, Split::ROWS).unwrap()),
        values(&whole)
    );
}

/// Each float parameter's gradient by path, and for a whole model each rank's part of it.
struct GradsByPath<'a, M: TensorParallel> {
    model: &'a M,
    grads: &'a burn::tensor::Gradients,
    at: Vec<String>,
    /// (path, rank's part or the rank's own gradient).
    out: Vec<(String, Vec<f32>)>,
    /// Some((rank, size)): cut each gradient to that rank's part.
    cut: Option<(usize, usize)>,
}

impl<M: TensorParallel> burn::module::ModuleVisitor for GradsByPath<'_, M> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.at.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.at.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let path = self.at.join(".");
        let grad = param
            .grad(self.grads)
            .unwrap_or_else(|| panic!("no gradient for `{path}`"));
        let grad = match self.cut {
            Some((rank, size)) => {
                part_of(grad, self.model.tp_split(&path, size), rank, size).unwrap()
            }
            None => grad,
        };
        self.out.push((path, values(&grad)));
    }
}

fn grads_by_path<M: burn::module::Module + TensorParallel>(
    model: &M,
    grads: &burn::tensor::Gradients,
    cut: Option<(usize, usize)>,
) -> Vec<(String, Vec<f32>)> {
    let mut v = GradsByPath {
        model,
        grads,
        at: Vec::new(),
        out: Vec::new(),
        cut,
    };
    model.visit(&mut v);
    v.out
}

fn gpt_config() -> crate::GptConfig {
    crate::GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 16,
        block_size: 8,
        vocab_size: 11,
        dropout: 0.0,
        bias: true,
    }
}

/// `sum(logits · w)` of a fixed batch of token ids.
fn gpt_loss(model: &crate::Gpt, device: &Device) -> (Vec<f32>, burn::tensor::Gradients) {
    let ids: Vec<i64> = (0..16).map(|i| (i * 7 % 11) as i64).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 8]), device);
    let logits = model.forward(tokens);
    let w = Tensor::<3>::from_data(TensorData::new(numbers(2 * 8 * 11, 4), [2, 8, 11]), device);
    let grads = (logits.clone() * w).sum().backward();
    (values(&logits), grads)
}

/// Every float parameter of `model` a tracked leaf (the GPT's zeroed biases are made by an op
/// on the initialised ones).
fn leaves<M: burn::module::Module>(model: M) -> M {
    struct Leaves;
    impl burn::module::ModuleMapper for Leaves {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| leaf(t).require_grad())
        }
    }
    model.map(&mut Leaves)
}

#[test]
fn the_gpt_cut_over_two_and_four_ranks_gives_one_devices_logits_and_gradients() {
    let device = Device::flex().autodiff();
    let whole = leaves(gpt_config().init(&device));
    let (logits, grads) = gpt_loss(&whole, &device);
    for size in [2, 4] {
        let threads: Vec<_> = Shared::group(size)
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let model = cut(whole.clone(), rank, size).unwrap();
                let expected = grads_by_path(&whole, &grads, Some((rank, size)));
                std::thread::spawn(move || {
                    let device = Device::flex().autodiff();
                    with_group(Some(group), || {
                        let (logits, grads) = gpt_loss(&model, &device);
                        (logits, grads_by_path(&model, &grads, None), expected)
                    })
                })
            })
            .collect();
        for (rank, t) in threads.into_iter().enumerate() {
            let (seen_logits, seen, expected) = t.join().unwrap();
            let at = |what: &str| format!("{what}, rank {rank} of {size}");
            assert_close(&at("logits"), &seen_logits, &logits, 1e-5);
            assert_eq!(seen.len(), expected.len());
            for ((path, g), (want_path, want)) in seen.iter().zip(&expected) {
                assert_eq!(path, want_path);
                assert_close(&at(path), g, want, 1e-5);
            }
        }
    }
    // A split that does not divide the heads is refused in one line; dropout is cut (its
    // masks are keyed draws, which a group draws as one device does).
    let e = cut(whole.clone(), 0, 3).unwrap_err();
    assert_eq!(
        e,
        "model.gpt.n_head (4) must be a multiple of the tensor-parallel size (3)"
    );
    let dropped = crate::GptConfig {
        dropout: 0.1,
        ..gpt_config()
    }
    .init(&device);
    assert!(crate::tp::TensorParallel::tp_draws_keyed(&dropped));
    assert!(cut(dropped, 0, 2).is_ok());
}

/// The host forms of a part and of the whole are the tensor forms' values, for a split along
/// each dimension and in blocks, and the whole comes back from the parts.
#[test]
fn parts_of_values_are_the_parts_of_tensors() {
    let device = Device::flex();
    let shape = [4usize, 24, 3];
    let n: usize = shape.iter().product();
    let all: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let whole = Tensor::<3>::from_data(TensorData::new(all.clone(), shape), &device);
    for split in [
        Split::Whole,
        Split::ROWS,
        Split::columns(1),
        Split::columns(3),
        Split::Parts { dim: 2, groups: 1 },
        // A fused projection of 4 query heads and 2 key/value heads, each 3 wide.
        Split::Heads {
            dim: 1,
            q: 4,
            kv: 2,
        },
    ] {
        let size = match split {
            Split::Parts { dim: 2, .. } => 3,
            _ => 2,
        };
        let mut parts = Vec::new();
        let mut part_shape = Vec::new();
        for rank in 0..size {
            let (values, s) = part_of_values(&all, &shape, split, rank, size).unwrap();
            let tensor = part_of(whole.clone(), split, rank, size).unwrap();
            assert_eq!(s, tensor.dims().to_vec(), "{split:?} rank {rank}");
            assert_eq!(
                values,
                tensor.try_into_vec_as::<f32>().unwrap(),
                "{split:?}"
            );
            parts.push(values);
            part_shape = s;
        }
        let (back, s) = whole_of_values(&parts, &part_shape, split).unwrap();
        assert_eq!((back, s), (all.clone(), shape.to_vec()), "{split:?}");
    }
    let e = part_of_values(&all, &shape, Split::columns(1), 0, 5).unwrap_err();
    assert!(e.contains("24") && e.contains("5"), "{e}");
}
