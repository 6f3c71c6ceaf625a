//! A layout's units moving between a module and flat buffers: a unit's values and gradients
//! read out, a gathered unit loaded into the module and released again.

use crate::params::param_tensor;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::FloatDType;

use super::layout::FlatLayout;

impl FlatLayout {
    /// Unit `u`'s parameter values in `module`, flattened in `dtype` and padded, on the
    /// parameters' device without autodiff.
    pub fn unit_values<M: Module>(
        &self,
        module: &M,
        u: usize,
        dtype: FloatDType,
        device: &Device,
    ) -> Tensor<1> {
        struct Collect<'a> {
            layout: &'a FlatLayout,
            unit: usize,
            dtype: FloatDType,
            parts: Vec<Tensor<1>>,
        }
        impl ModuleVisitor for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let Some(e) = self.layout.entry(param.id) else {
                    return;
                };
                if e.unit == self.unit {
                    let t = param.val().inner().reshape([e.numel]);
                    self.parts.push(t.cast(self.dtype));
                }
            }
        }
        let mut c = Collect {
            layout: self,
            unit: u,
            dtype,
            parts: Vec::new(),
        };
        module.visit(&mut c);
        self.padded_cat(c.parts, u, dtype, device)
    }

    /// Unit `u`'s gradients, removed from `grads`, flattened in `dtype` and padded (zeros for
    /// parameters without a gradient).
    pub fn unit_grads<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
        u: usize,
        dtype: FloatDType,
        device: &Device,
    ) -> Tensor<1> {
        struct Collect<'a> {
            layout: &'a FlatLayout,
            grads: &'a mut GradientsParams,
            unit: usize,
            dtype: FloatDType,
            device: Device,
            parts: Vec<Tensor<1>>,
        }
        impl ModuleVisitor for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let Some(e) = self.layout.entry(param.id) else {
                    return;
                };
                if e.unit != self.unit {
                    return;
                }
                let part = match self.grads.remove::<D>(param.id) {
                    Some(g) => g.reshape([e.numel]),
                    None => Tensor::<1>::zeros([e.numel], &self.device.clone().without_autodiff())
                        .cast(self.dtype),
                };
                self.parts.push(part);
            }
        }
        let mut c = Collect {
            layout: self,
            grads,
            unit: u,
            dtype,
            device: device.clone(),
            parts: Vec::new(),
        };
        module.visit(&mut c);
        // Gradients of one dtype (a compute copy's bf16) are put side by side in it and cast
        // once: one cast of the unit, not one a parameter (the same values: a cast is exact
        // element by element).
        let first = c.parts.first().map(|p| p.dtype());
        match first {
            Some(low) if c.parts.iter().all(|p| p.dtype() == low) => {
                let low = FloatDType::from(low);
                self.padded_cat(c.parts, u, low, device).cast(dtype)
            }
            _ => {
                let parts = c.parts.into_iter().map(|p| p.cast(dtype)).collect();
                self.padded_cat(parts, u, dtype, device)
            }
        }
    }

    /// The units that have at least one gradient in `grads`, in unit order.
    pub fn units_in<M: Module>(&self, module: &M, grads: &GradientsParams) -> Vec<usize> {
        struct Find<'a> {
            layout: &'a FlatLayout,
            grads: &'a GradientsParams,
            found: Vec<bool>,
        }
        impl ModuleVisitor for Find<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(e) = self.layout.entry(param.id)
                    && self.grads.get::<D>(param.id).is_some()
                {
                    self.found[e.unit] = true;
                }
            }
        }
        let mut f = Find {
            layout: self,
            grads,
            found: vec![false; self.units.len()],
        };
        module.visit(&mut f);
        (0..self.units.len()).filter(|&u| f.found[u]).collect()
    }

    fn padded_cat(
        &self,
        mut parts: Vec<Tensor<1>>,
        u: usize,
        dtype: FloatDType,
        device: &Device,
    ) -> Tensor<1> {
        let unit = &self.units[u];
        let pad = unit.padded(self.shards) - unit.len;
        if pad > 0 {
            parts.push(Tensor::<1>::zeros([pad], &device.clone().without_autodiff()).cast(dtype));
        }
        if parts.is_empty() {
            return Tensor::<1>::zeros([0], &device.clone().without_autodiff()).cast(dtype);
        }
        Tensor::cat(parts, 0)
    }

    /// `module` with unit `u`'s parameters taken from `flat` (the unit's flat space, padded or
    /// not, on the device), in `dtype`, as trainable values on `device`.
    pub fn load_unit<M: Module>(
        &self,
        module: M,
        u: usize,
        flat: Tensor<1>,
        dtype: FloatDType,
        device: &Device,
    ) -> M {
        struct Load<'a> {
            layout: &'a FlatLayout,
            unit: usize,
            flat: Tensor<1>,
            dtype: FloatDType,
            device: &'a Device,
        }
        impl ModuleMapper for Load<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let Some(e) = self.layout.entry(param.id) else {
                    return param;
                };
                if e.unit != self.unit {
                    return param;
                }
                let shape: [usize; D] = e.shape.clone().try_into().expect("the entry's rank");
                let value = self
                    .flat
                    .clone()
                    .slice(e.offset..e.offset + e.numel)
                    .reshape(shape)
                    .cast(self.dtype);
                // A frozen parameter (a frozen layout's unit) stays without gradient.
                let device = self.device;
                let trained = param.is_require_grad();
                param.map(|_| {
                    if trained {
                        param_tensor(value, device)
                    } else {
                        value
                    }
                })
            }
        }
        let mut l = Load {
            layout: self,
            unit: u,
            flat,
            dtype,
            device,
        };
        module.map(&mut l)
    }

    /// `module` with unit `u`'s parameters replaced by one-element placeholders (zero-sized
    /// in what they hold), keeping their ids and shapes' ranks: the unit is released.
    pub fn release_unit<M: Module>(&self, module: M, u: usize, device: &Device) -> M {
        struct Release<'a> {
            layout: &'a FlatLayout,
            unit: usize,
            device: &'a Device,
        }
        impl ModuleMapper for Release<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                match self.layout.entry(param.id) {
                    Some(e) if e.unit == self.unit => {
                        let device = self.device;
                        let inner = Tensor::<D>::zeros([1; D], &device.clone().without_autodiff());
                        let trained = param.is_require_grad();
                        param.map(|_| {
                            if trained {
                                param_tensor(inner, device)
                            } else {
                                inner
                            }
                        })
                    }
                    _ => param,
                }
            }
        }
        module.map(&mut Release {
            layout: self,
            unit: u,
            device,
        })
    }
}
