//! What kiln does to any Burn module: seeded construction one at a time, a Linear over the
//! rows of `[B, T, C]`, a position embedding's rows, parameters materialised, their ids and
//! dotted paths.

use burn::prelude::*;

pub use crate::draw::with_rng;

/// `linear` on `[B, T, C]` as one matrix product over the `B·T` rows. Burn's `linear` keeps
/// a batched product when T is a multiple of its row tile — one gemm per batch row, each
/// packing the same weight again; flattened first, it is one gemm whatever B. Each output
/// element sums over C in the same order either way.
///
/// The product is [`crate::fused::linear`]: on the CPU in f32, one kernel that writes its
/// output's own buffer; on a GPU [`crate::cube::linear`], the rows cut into parts so that the
/// weight's gradient is summed by parts; elsewhere Burn's `linear`.
pub fn linear_rows(linear: &burn::nn::Linear, x: Tensor<3>) -> Tensor<3> {
    on_rows(x, |rows| {
        let bias = linear.bias.as_ref().map(|b| b.val());
        crate::fused::linear(rows, linear.weight.val(), bias)
    })
}

/// `f` on `[B, T, C]` seen as its `[B·T, C]` rows, the result back as `[B, T, N]`.
pub fn on_rows(x: Tensor<3>, f: impl FnOnce(Tensor<2>) -> Tensor<2>) -> Tensor<3> {
    let [b, t, c] = x.dims();
    let y = f(x.reshape([b * t, c]));
    let n = y.dims()[1];
    y.reshape([b, t, n])
}

/// Rows `start..start + t` of a learned position embedding as `[1, t, C]`, added to a batch's
/// `[B, t, C]` token embeddings by broadcasting. Its gradient sums over the batch and then
/// fills those rows. Looking the positions up as `[B, t]` ids instead (what `Embedding` does)
/// scatters `B·t` gradient rows into `t`; a GPU does that with atomic adds that collide on
/// every row. Two such scatters took 5.8 ms of a 58 ms step of the GPT GPU recipe on CUDA
/// (BENCHMARKS.md).
pub fn position_rows(wpe: &burn::nn::Embedding, start: usize, t: usize) -> Tensor<3> {
    let weight = wpe.weight.val();
    let c = weight.dims()[1];
    weight.slice([start..start + t, 0..c]).reshape([1, t, c])
}

/// Forces the initialisation of every parameter of `module`.
///
/// Burn initialises parameters lazily, on first use; drawing their random values here, inside
/// [`with_rng`], keeps them reproducible.
pub fn materialized<M: Module>(module: M) -> M {
    struct Touch;
    impl burn::module::ModuleVisitor for Touch {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Touch);
    module
}

/// The ids of every float parameter of `module` (trained or not), in module order: what
/// [`BlockStack::block_params`](crate::blocks::BlockStack::block_params) returns for a block's sub-module.
pub fn param_ids<M: Module>(module: &M) -> Vec<burn::module::ParamId> {
    struct Ids(Vec<burn::module::ParamId>);
    impl burn::module::ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// The path of every float parameter of `module` (`model.layers.0.self_attn.q_proj.weight`),
/// in module order, as weight files name them.
pub fn param_paths<M: Module>(module: &M) -> Vec<String> {
    struct Paths {
        at: Vec<String>,
        out: Vec<String>,
    }
    impl burn::module::ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.at.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.at.pop();
        }
        fn visit_float<const D: usize>(&mut self, _param: &burn::module::Param<Tensor<D>>) {
            self.out.push(self.at.join("."));
        }
    }
    let mut paths = Paths {
        at: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut paths);
    paths.out
}

/// How many tables a [`kept_per_thread`] cache holds: a run asks for one or two spans (its
/// training and evaluation lengths); a decoding loop for a new one per token.
const KEPT: usize = 8;

/// `build()`'s value for `key`, kept in `cache` (a thread's own) for the next call with an
/// equal key: for constant tables (rotary angles, attention masks) that a model would otherwise
/// build on the host and upload in every block of every forward. The oldest of [`KEPT`] goes
/// first.
pub(crate) fn kept_per_thread<K: PartialEq, V: Clone>(
    cache: &'static std::thread::LocalKey<std::cell::RefCell<Vec<(K, V)>>>,
    key: K,
    build: impl FnOnce() -> V,
) -> V {
    let found = cache.with_borrow(|c| c.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone()));
    if let Some(value) = found {
        return value;
    }
    let value = build();
    cache.with_borrow_mut(|c| {
        if c.len() == KEPT {
            c.remove(0);
        }
        c.push((key, value.clone()));
    });
    value
}

/// A device with its gradient settings, as [`device_key`] makes it.
pub(crate) type DeviceKey = (Device, Option<burn::tensor::GradientCheckpointingStrategy>);

/// What a device-held constant depends on besides its values: the device, and whether (and
/// how) it records gradients — [`Device`]'s own equality ignores both.
pub(crate) fn device_key(device: &Device) -> DeviceKey {
    (device.clone(), device.gradient_checkpointing_strategy())
}
