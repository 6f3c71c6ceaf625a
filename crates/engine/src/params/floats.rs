//! A module's floats: read to the host, replaced from flat buffers, its buffers and their
//! ids, dtypes and sizes. Burn's module traversal, and nothing of kiln's other layers.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};

/// The float tensors of `module` in module order, one vector each: all of them, only those that
/// are trained (`Some(true)`), or only its buffers (`Some(false)`: running state, not frozen
/// parameters; see [`running_state_ids`]).
pub fn float_tensors<M: Module>(module: &M, trainable: Option<bool>) -> Vec<Vec<f32>> {
    struct Collect {
        trainable: Option<bool>,
        buffers: HashSet<ParamId>,
        out: Vec<Vec<f32>>,
    }
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            match self.trainable {
                Some(true) if !param.is_require_grad() => return,
                Some(false) if !self.buffers.contains(&param.id) => return,
                _ => {}
            }
            self.out.push(host_f32(param.val()));
        }
    }
    let buffers = if trainable == Some(false) {
        running_state_ids(module)
    } else {
        HashSet::new()
    };
    let mut c = Collect {
        trainable,
        buffers,
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
        buffers: HashSet<ParamId>,
        values: Vec<f32>,
        offset: usize,
        device: &'a Device,
    }
    impl ModuleMapper for Replace<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let replaced = if self.trainable {
                param.is_require_grad()
            } else {
                self.buffers.contains(&param.id)
            };
            if !replaced {
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
    let buffers = if trainable {
        HashSet::new()
    } else {
        running_state_ids(&module)
    };
    let mut r = Replace {
        trainable,
        buffers,
        values,
        offset: 0,
        device,
    };
    module.map(&mut r)
}

/// Bytes of the frozen parameters `module` holds (a released one, a placeholder, counts one
/// element).
pub fn frozen_bytes<M: Module>(module: &M) -> usize {
    struct Count(HashSet<ParamId>, usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() && !self.0.contains(&param.id) {
                let value = param.val();
                let dtype = value.dtype();
                self.1 += if dtype.is_float() {
                    param.shape().num_elements() * dtype_bytes(float_dtype(dtype))
                } else {
                    // A quantized base: its packed values and scales as the backend holds
                    // them (read once, when a strategy sets a rank up).
                    value.to_data().as_bytes().len()
                };
            }
        }
    }
    let mut c = Count(running_state_ids(module), 0);
    module.visit(&mut c);
    c.1
}

/// The frozen float parameters of `module` in module order: id, shape and values. A quantized
/// base (QLoRA's) is not among them: every rank keeps it whole, packed, as the layout does
/// (`Kind::Quantized`), so a pipeline stage neither releases nor sends it.
pub fn frozen_with_ids<M: Module>(module: &M) -> Vec<(ParamId, Vec<usize>, Vec<f32>)> {
    struct Collect(HashSet<ParamId>, Vec<(ParamId, Vec<usize>, Vec<f32>)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if value.dtype().is_float() && !param.is_require_grad() && !self.0.contains(&param.id) {
                let shape = param.shape().to_vec();
                self.1.push((param.id, shape, host_f32(value)));
            }
        }
    }
    let mut c = Collect(running_state_ids(module), Vec::new());
    module.visit(&mut c);
    c.1
}

/// `module` with the parameters of `values` (by id: shape and values) set to them in
/// `dtype`, without gradient, on `device`; a shape of `[1; D]` zeros where `values` holds an
/// empty shape releases the parameter (a placeholder, as a released unit's).
pub fn set_frozen<M: Module>(
    module: M,
    values: &HashMap<ParamId, (Vec<usize>, Vec<f32>)>,
    dtype: FloatDType,
    device: &Device,
) -> M {
    struct Set<'a> {
        values: &'a HashMap<ParamId, (Vec<usize>, Vec<f32>)>,
        dtype: FloatDType,
        device: Device,
    }
    impl ModuleMapper for Set<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some((shape, values)) = self.values.get(&param.id) else {
                return param;
            };
            let t = if shape.is_empty() {
                Tensor::<D>::zeros([1; D], &self.device)
            } else {
                let data = TensorData::new(values.clone(), shape.clone());
                Tensor::<D>::from_data(data, &self.device)
            };
            let t = t.cast(self.dtype);
            param.map(|_| t)
        }
    }
    module.map(&mut Set {
        values,
        dtype,
        device: device.clone().without_autodiff(),
    })
}

/// The buffers (float tensors that are not trained) of `module` in module order, with their
/// ids.
pub fn buffers_with_ids<M: Module>(module: &M) -> Vec<(ParamId, Vec<f32>)> {
    struct Collect(HashSet<ParamId>, Vec<(ParamId, Vec<f32>)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.contains(&param.id) {
                self.1.push((param.id, host_f32(param.val())));
            }
        }
    }
    let mut c = Collect(running_state_ids(module), Vec::new());
    module.visit(&mut c);
    c.1
}

/// Folds the pending updates of Burn's `RunningState` buffers (e.g. BatchNorm statistics) into
/// their values. A `RunningState` keeps the last update of each thread aside until it is next
/// read for a forward pass, so visiting the module right after a step would see the previous
/// step's statistics; `valid` folds the pending updates in as a side effect on the shared state.
pub fn sync_running_state<M: Module>(module: &M) {
    let _ = module.valid();
}

/// Whether `module` holds buffers: float state that is not trained and is not a parameter
/// (Burn's `RunningState`, e.g. BatchNorm statistics).
pub fn has_buffers<M: Module>(module: &M) -> bool {
    !running_state_ids(module).is_empty()
}

/// The ids of `module`'s buffers: Burn's `RunningState` values (BatchNorm statistics), which
/// the forward pass updates. A parameter that is frozen (`[finetune]`, LoRA's bases) is not
/// trained either but is not one: it never changes, so no strategy averages or restores it.
/// The two look alike to a visitor; a mapper tells them apart, since a parameter keeps the id
/// the mapper hands back and a `RunningState` keeps its own (the mapping runs on a clone, and
/// hands a `RunningState` back the tensor it had).
pub fn running_state_ids<M: Module>(module: &M) -> HashSet<ParamId> {
    struct Frozen(HashSet<ParamId>);
    impl ModuleVisitor for Frozen {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
                self.0.insert(param.id);
            }
        }
    }
    struct Relabel;
    impl ModuleMapper for Relabel {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if param.is_require_grad() {
                return param;
            }
            Param::initialized(ParamId::new(), param.val())
        }
    }
    let mut before = Frozen(HashSet::new());
    module.visit(&mut before);
    if before.0.is_empty() {
        return before.0;
    }
    let mut after = Frozen(HashSet::new());
    module.clone().map(&mut Relabel).visit(&mut after);
    before.0.intersection(&after.0).copied().collect()
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

/// The dtype of every float parameter of `module` (a quantized base's too), in module order.
pub fn float_dtypes<M: Module>(module: &M) -> Vec<DType> {
    struct Dtypes(Vec<DType>);
    impl ModuleVisitor for Dtypes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().dtype());
        }
    }
    let mut dtypes = Dtypes(Vec::new());
    module.visit(&mut dtypes);
    dtypes.0
}

/// A tensor's values on the host as f32 (exact for bf16 and f16): an f32 tensor's read once,
/// its bytes kept as the vector where they can be.
pub fn host_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    let data = t.into_data();
    if data.dtype() == DType::F32 {
        return data.try_into_vec::<f32>().expect("f32 values read as f32");
    }
    data.convert::<f32>().iter::<f32>().collect()
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

#[cfg(test)]
mod tests {
    use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};

    use super::*;

    #[derive(burn::module::Module, Debug)]
    struct Net {
        norm: BatchNorm,
        frozen: Linear,
        trained: Linear,
    }

    #[test]
    fn buffers_are_running_state_and_not_frozen_parameters() {
        let device = Device::flex().autodiff();
        let net = Net {
            norm: BatchNormConfig::new(3).init(&device),
            frozen: LinearConfig::new(3, 3).init(&device),
            trained: LinearConfig::new(3, 2).init(&device),
        };
        let net = Net {
            frozen: net.frozen.clone().freeze(),
            ..net
        };
        let ids = running_state_ids(&net);
        assert_eq!(ids.len(), 2, "BatchNorm's mean and variance");
        assert_eq!(ids, running_state_ids(&net.norm));
        assert!(running_state_ids(&net.frozen).is_empty());
        assert!(has_buffers(&net));
        // The frozen weights are neither trained nor buffers.
        assert_eq!(collect_floats(&net, false).len(), 6);
        assert_eq!(collect_floats(&net, true).len(), 3 + 3 + 3 * 2 + 2);
        assert_eq!(buffers_with_ids(&net).len(), 2);
    }
}
