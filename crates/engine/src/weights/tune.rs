//! `[finetune]` on a model: frozen parameters by module path pattern, LoRA adapters (Burn's
//! [`Lora`]) on the 2-D weights of the target modules with everything else frozen, and the
//! counts the start-up table and `summary.json` report.

use burn::module::{Lora, Module, ModuleVisitor, Param, ParamGroup, ParamId, QLora, Quantizer};
use burn::prelude::*;
use burn::tensor::quantization::{Calibration, QuantValue};

use crate::config::{FinetuneConfig, QuantBits};
use crate::error::{Error, Result};

/// One float parameter of a model: its path as the exported names read, its shape, and
/// whether it trains.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// `blocks.0.attn.qkv.weight`; an adapter factor reads `blocks.0.attn.qkv.weight.lora.a`.
    pub path: String,
    /// Its id (kept by clones of the module).
    pub id: ParamId,
    /// Its shape.
    pub dims: Vec<usize>,
    /// Whether it gets a gradient.
    pub trainable: bool,
}

/// Every float parameter of `module` (buffers such as running statistics included), in
/// module order, with its path.
pub fn param_infos<M: Module>(module: &M) -> Vec<ParamInfo> {
    struct Walk {
        path: Vec<String>,
        out: Vec<ParamInfo>,
    }
    impl ModuleVisitor for Walk {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.out.push(ParamInfo {
                path: self.path.join("."),
                id: param.id,
                dims: param.lazy_shape().to_vec(),
                trainable: param.is_require_grad(),
            });
        }
    }
    let mut walk = Walk {
        path: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut walk);
    walk.out
}

/// Trainable and total parameter counts of `module` (elements; adapters included, buffers
/// counted as not trainable).
pub fn count_params<M: Module>(module: &M) -> (usize, usize) {
    param_infos(module).iter().fold((0, 0), |(t, all), p| {
        let n: usize = p.dims.iter().product();
        (t + if p.trainable { n } else { 0 }, all + n)
    })
}

/// Whether `pattern` names the module or parameter at `path` or one that holds it: the
/// pattern matches the path's first segments. `*` within a segment matches any text, a `**`
/// segment any number of segments.
pub fn matches(pattern: &str, path: &str) -> bool {
    let pattern: Vec<&str> = pattern.split('.').collect();
    let path: Vec<&str> = path.split('.').collect();
    prefix_match(&pattern, &path)
}

fn prefix_match(pattern: &[&str], path: &[&str]) -> bool {
    match pattern.split_first() {
        None => true,
        Some((&"**", rest)) => (0..=path.len()).any(|skip| prefix_match(rest, &path[skip..])),
        Some((seg, rest)) => match path.split_first() {
            Some((p, tail)) => {
                segment_match(seg.as_bytes(), p.as_bytes()) && prefix_match(rest, tail)
            }
            None => false,
        },
    }
}

/// `*` matches any run of characters within one segment.
fn segment_match(pattern: &[u8], text: &[u8]) -> bool {
    match pattern.split_first() {
        None => text.is_empty(),
        Some((b'*', rest)) => (0..=text.len()).any(|k| segment_match(rest, &text[k..])),
        Some((c, rest)) => text.first() == Some(c) && segment_match(rest, &text[1..]),
    }
}

/// The parameters `patterns` name (in module order), refused in one line when a pattern
/// names none of them: a typo must not train the whole model.
fn matching<'a>(
    params: &'a [ParamInfo],
    patterns: &[String],
    key: &str,
) -> Result<Vec<&'a ParamInfo>> {
    for (i, pattern) in patterns.iter().enumerate() {
        if !params.iter().any(|p| matches(pattern, &p.path)) {
            return Err(Error::config(format!(
                "key `{key}[{i}]`: {pattern:?} matches no parameter of the model (its modules: \
                 {})",
                top_modules(params)
            )));
        }
    }
    Ok(params
        .iter()
        .filter(|p| patterns.iter().any(|pat| matches(pat, &p.path)))
        .collect())
}

/// The model's paths, shortened to what a user picks from: the first two segments, each once.
fn top_modules(params: &[ParamInfo]) -> String {
    let mut seen: Vec<String> = Vec::new();
    for p in params {
        let short: Vec<&str> = p.path.split('.').take(2).collect();
        let short = short.join(".");
        if !seen.contains(&short) {
            seen.push(short);
        }
    }
    let more = seen.len().saturating_sub(12);
    seen.truncate(12);
    let tail = if more > 0 {
        format!(", and {more} more")
    } else {
        String::new()
    };
    format!("{}{tail}", seen.join(", "))
}

/// `model` as `[finetune]` says: the parameters of `freeze` frozen; with LoRA, an adapter on
/// each 2-D weight of the target modules and every other parameter frozen (the adapters'
/// initial values come from the device's random numbers: rank 0's are copied to the others).
/// A pattern that names nothing, and a LoRA target without a 2-D weight, are refused in one
/// line.
pub fn apply<M: Module>(model: M, tune: &FinetuneConfig) -> Result<M> {
    let params = param_infos(&model);
    let mut model = model;
    if !tune.freeze.is_empty() {
        let frozen: Vec<ParamId> = matching(&params, &tune.freeze, "finetune.freeze")?
            .iter()
            .map(|p| p.id)
            .collect();
        model = model.set_require_grad_group(ParamGroup::from_ids(frozen), false);
    }
    let Some(lora) = &tune.lora else {
        return Ok(model);
    };
    let key = "finetune.lora.targets";
    let targets = matching(&params, &lora.targets, key)?;
    for (i, pattern) in lora.targets.iter().enumerate() {
        let weights = targets
            .iter()
            .filter(|p| matches(pattern, &p.path) && p.dims.len() == 2)
            .count();
        if weights == 0 {
            let named: Vec<String> = targets
                .iter()
                .filter(|p| matches(pattern, &p.path))
                .take(3)
                .map(|p| format!("{} {:?}", p.path, p.dims))
                .collect();
            return Err(Error::config(format!(
                "key `{key}[{i}]`: {pattern:?} names no 2-D weight (LoRA adapts matrices), \
                 only {}",
                named.join(", ")
            )));
        }
    }
    let adapted: Vec<ParamId> = targets
        .iter()
        .filter(|p| p.dims.len() == 2)
        .map(|p| p.id)
        .collect();
    let group = ParamGroup::from_ids(adapted);
    let adapter = Lora::new(lora.rank, lora.alpha).set_param_group(group.clone());
    let Some(bits) = lora.quantize else {
        return Ok(model.apply_lora(adapter));
    };
    let device = model
        .devices()
        .into_iter()
        .next()
        .expect("a model lives on a device");
    let value = match bits {
        QuantBits::Q8 => QuantValue::Q8S,
        QuantBits::Q4 => QuantValue::Q4S,
    };
    let scheme = device.settings().quantization.scheme.with_value(value);
    let mut quantizer = Quantizer::new(Calibration::MinMax, scheme);
    quantizer.set_param_group(group);
    Ok(model.apply_qlora(QLora::new(adapter, quantizer)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_names_a_module_and_what_it_holds() {
        assert!(matches("blocks.*.attn.qkv", "blocks.0.attn.qkv.weight"));
        assert!(matches("blocks", "blocks.3.mlp.fc.weight"));
        assert!(matches("**.qkv", "blocks.3.attn.qkv.weight"));
        assert!(matches("blocks.1*", "blocks.12.ln_1.gamma"));
        assert!(!matches("blocks.*.attn.qkv", "blocks.0.attn.proj.weight"));
        assert!(!matches("wte.weight.x", "wte.weight"));
        assert!(!matches("blocks.1", "blocks.12.ln_1.gamma"));
    }
}
