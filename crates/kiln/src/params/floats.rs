//! A module's floats: read to the host, replaced from flat buffers, its buffers and their
//! ids, dtypes and sizes. Burn's module traversal, and nothing of kiln's other layers.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};

/// The float tensors of `module` in module order, one vector each: all of them, or only those
/// that are (`Some(true)`) or are not (`Some(false)`, buffers) trained.
pub fn float_tensors<M: Module>(module: &M, trainable: Option<bool>) -> Vec<Vec<f32>> {
    struct Collect {
        trainable: Option<bool>,
        out: Vec<Vec<f32>>,
    }
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.trainable.is_some_and(|t| param.is_require_grad() != t) {
                return;
            }
            self.out.push(host_f32(param.val()));
        }
    }
    let mut c = Collect {
        trainable,
        out: Vec::new(),
    };
    module.visit(&mut c);
    c.out
}

/// The values of every float tensor of `module` (parameters and buffers such as BatchNorm
/// statistics), one vector per tensor in module order, for comparing replicas or runs.
pub fn parameter_values<M: Module>(module: &M) -> Vec<Vec<f32>> {
    float_tensors(module, None)
}

/// The float tensors of `module` that are (`trainable`) or are not (buffers) trained,
/// flattened into one host buffer in module order.
pub fn collect_floats<M: Module>(module: &M, trainable: bool) -> Vec<f32> {
    float_tensors(module, Some(trainable)).concat()
}

/// Replaces the float tensors [`collect_floats`] collected with `values`, each in the dtype it
/// had (a bf16 buffer stays bf16).
pub fn replace_floats<M: Module>(
    module: M,
    trainable: bool,
    values: Vec<f32>,
    device: &Device,
) -> M {
    struct Replace<'a> {
        trainable: bool,
        values: Vec<f32>,
        offset: usize,
        device: &'a Device,
    }
    impl ModuleMapper for Replace<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if param.is_require_grad() != self.trainable {
                return param;
            }
            let shape = param.shape();
            let dtype = float_dtype(param.val().dtype());
            let n = shape.num_elements();
            let slice = self.values[self.offset..self.offset + n].to_vec();
            self.offset += n;
            let device = self.device.clone().without_autodiff();
            let tensor = Tensor::<D>::from_data(TensorData::new(slice, shape), &device).cast(dtype);
            let tracked = self.trainable;
            let device = self.device.clone();
            param.map(|_| {
                if tracked {
                    param_tensor(tensor, &device)
                } else {
                    tensor
                }
            })
        }
    }
    let mut r = Replace {
        trainable,
        values,
        offset: 0,
        device,
    };
    module.map(&mut r)
}

/// The buffers (float tensors that are not trained) of `module` in module order, with their
/// ids.
pub fn buffers_with_ids<M: Module>(module: &M) -> Vec<(ParamId, Vec<f32>)> {
    struct Collect(Vec<(ParamId, Vec<f32>)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
                self.0.push((param.id, host_f32(param.val())));
            }
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// Folds the pending updates of Burn's `RunningState` buffers (e.g. BatchNorm statistics) into
/// their values. A `RunningState` keeps the last update of each thread aside until it is next
/// read for a forward pass, so visiting the module right after a step would see the previous
/// step's statistics; `valid` folds the pending updates in as a side effect on the shared state.
pub fn sync_running_state<M: Module>(module: &M) {
    let _ = module.valid();
}

/// Whether `module` holds float state that is not trained (buffers).
pub fn has_buffers<M: Module>(module: &M) -> bool {
    struct Find(bool);
    impl ModuleVisitor for Find {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 |= !param.is_require_grad();
        }
    }
    let mut f = Find(false);
    module.visit(&mut f);
    f.0
}

/// The ids of the trainable float parameters of `module`, in module order.
pub fn trainable_ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_require_grad() {
                self.0.push(param.id);
            }
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// A tensor's values on the host as f32 (exact for bf16 and f16).
pub fn host_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().iter::<f32>().collect()
}

/// The float dtype of a tensor's `DType` (f32 for anything that is not a float).
pub fn float_dtype(dtype: DType) -> FloatDType {
    match dtype {
        DType::BF16 => FloatDType::BF16,
        DType::F16 => FloatDType::F16,
        DType::F64 => FloatDType::F64,
        _ => FloatDType::F32,
    }
}

/// Bytes of one element of `dtype`.
pub fn dtype_bytes(dtype: FloatDType) -> usize {
    match dtype {
        FloatDType::BF16 | FloatDType::F16 => 2,
        FloatDType::F64 => 8,
        _ => 4,
    }
}

/// `inner` (a tensor without autodiff) as a trainable parameter value on `device`: with
/// autodiff, the device's gradient-checkpointing strategy, and its gradient kept. On a device
/// without autodiff the tensor is returned as it is.
pub fn param_tensor<const D: usize>(inner: Tensor<D>, device: &Device) -> Tensor<D> {
    if !device.is_autodiff() {
        return inner;
    }
    let t = inner.autodiff();
    let t = match device.gradient_checkpointing_strategy() {
        Some(s) => t.with_gradient_checkpointing_strategy(s),
        None => t,
    };
    t.require_grad()
}
