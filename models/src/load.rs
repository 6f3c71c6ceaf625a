//! Rebuilding a trained model in another program: a [`ModelSpec`] plus a weights file
//! (burnpack or SafeTensors), or a kiln run directory that holds both.

use std::fmt;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use burn::store::{ModuleSnapshot, SafetensorsStore};
use serde::{Deserialize, Serialize};

use crate::blocks::{Activation, BlockStack};
use crate::convnet::ConvNet;
use crate::mlp::Mlp;
use crate::registry::{FamilyVisitor, LanguageModel, ModelKind, ModelSection, Registered};
use crate::step::{ImageBatch, InputSpec, StepOutput, TrainStep};

/// Everything needed to rebuild a model: its architecture and, for image classifiers, the
/// input shape (a GPT's vocabulary and context live in its own config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The architecture.
    pub model: ModelSection,
    /// The input an image classifier was built for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<InputSpec>,
}

impl ModelSpec {
    /// Checks that the spec describes a buildable model.
    pub fn validate(&self) -> Result<(), String> {
        let input = || {
            self.input
                .ok_or_else(|| "an image classifier needs its input shape".to_string())
        };
        match self.model.kind {
            ModelKind::Convnet => self.model.convnet.validate(&input()?),
            ModelKind::Mlp => input().and_then(|_| self.model.mlp.validate()),
            ModelKind::Hf => Err(
                "model.kind = \"hf\" is resolved from init.from's config.json before a model \
                 is built"
                    .into(),
            ),
            _ => self.model.validate_family(),
        }
    }

    /// Builds a freshly initialised classifier on `device`; a GPT spec is an error.
    pub fn classifier(&self, device: &Device) -> Result<Classifier, String> {
        let input = self
            .input
            .ok_or_else(|| "an image classifier needs its input shape".to_string())?;
        match self.model.kind {
            ModelKind::Convnet => Ok(Classifier::ConvNet(self.model.convnet.init(&input, device))),
            ModelKind::Mlp => Ok(Classifier::Mlp(self.model.mlp.init(&input, device))),
            kind => Err(format!(
                "model.kind = {:?} is a language model, not an image classifier",
                format!("{kind:?}").to_lowercase()
            )),
        }
    }

    /// Training FLOPs of one image through the classifier this spec builds; `None` for a
    /// language model or a spec without its input shape.
    pub fn classifier_flops_per_sample(&self) -> Option<f64> {
        let input = self.input?;
        match self.model.kind {
            ModelKind::Convnet => Some(self.model.convnet.flops_per_sample(&input)),
            ModelKind::Mlp => Some(self.model.mlp.flops_per_sample(&input)),
            _ => None,
        }
    }
}

/// Any of the image classifiers, as one module type.
#[derive(Module, Debug)]
pub enum Classifier {
    /// A [`ConvNet`].
    ConvNet(ConvNet),
    /// An [`Mlp`].
    Mlp(Mlp),
}

impl Classifier {
    /// Class logits `[batch, classes]` for images `[batch, channels, h, w]` scaled to `[0, 1]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        match self {
            Classifier::ConvNet(m) => m.forward(images),
            Classifier::Mlp(m) => m.forward(images),
        }
    }

    /// The most likely class of every image.
    pub fn predict(&self, images: Tensor<4>) -> Vec<usize> {
        let classes = self.forward(images).argmax(1);
        classes
            .into_data()
            .iter::<i64>()
            .map(|c| c as usize)
            .collect()
    }
}

impl BlockStack<ImageBatch> for Classifier {
    fn num_blocks(&self) -> usize {
        match self {
            Classifier::ConvNet(m) => m.num_blocks(),
            Classifier::Mlp(m) => m.num_blocks(),
        }
    }

    fn stem(&self, batch: &ImageBatch) -> Activation {
        match self {
            Classifier::ConvNet(m) => m.stem(batch),
            Classifier::Mlp(m) => m.stem(batch),
        }
    }

    fn block(&self, i: usize, x: Activation) -> Activation {
        match self {
            Classifier::ConvNet(m) => m.block(i, x),
            Classifier::Mlp(m) => m.block(i, x),
        }
    }

    fn block_params(&self, i: usize) -> Vec<burn::module::ParamId> {
        match self {
            Classifier::ConvNet(m) => m.block_params(i),
            Classifier::Mlp(m) => m.block_params(i),
        }
    }

    fn block_norm(&self, i: usize) -> Option<&burn::nn::BatchNorm> {
        match self {
            Classifier::ConvNet(m) => m.block_norm(i),
            Classifier::Mlp(m) => m.block_norm(i),
        }
    }

    fn before_norm(&self, i: usize, x: Activation) -> Activation {
        match self {
            Classifier::ConvNet(m) => m.before_norm(i, x),
            Classifier::Mlp(m) => m.before_norm(i, x),
        }
    }

    fn after_norm(&self, i: usize, x: Activation) -> Activation {
        match self {
            Classifier::ConvNet(m) => m.after_norm(i, x),
            Classifier::Mlp(m) => m.after_norm(i, x),
        }
    }

    fn head(&self, x: Activation, batch: &ImageBatch) -> StepOutput {
        match self {
            Classifier::ConvNet(m) => m.head(x, batch),
            Classifier::Mlp(m) => m.head(x, batch),
        }
    }
}

impl TrainStep<ImageBatch> for Classifier {
    fn step(&self, batch: ImageBatch) -> StepOutput {
        match self {
            Classifier::ConvNet(m) => m.step(batch),
            Classifier::Mlp(m) => m.step(batch),
        }
    }
}

/// Why a model could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// A file could not be read.
    Io(PathBuf, std::io::Error),
    /// The spec file is not a valid [`ModelSpec`].
    Spec(PathBuf, String),
    /// The weights file could not be read or does not fit the model.
    Weights(PathBuf, String),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Io(p, e) => write!(f, "{}: {e}", p.display()),
            LoadError::Spec(p, e) => write!(f, "{}: invalid model spec: {e}", p.display()),
            LoadError::Weights(p, e) => write!(f, "{}: cannot load weights: {e}", p.display()),
        }
    }
}

impl std::error::Error for LoadError {}

/// File name of the model spec inside a run directory.
pub const SPEC_FILE: &str = "model.toml";
/// File name of the final burnpack weights inside a run directory.
pub const WEIGHTS_FILE: &str = "model.bpk";
/// File name of the final SafeTensors weights inside a run directory.
pub const SAFETENSORS_FILE: &str = "model.safetensors";

/// Reads a [`ModelSpec`] from a TOML file.
pub fn read_spec(path: &Path) -> Result<ModelSpec, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::Io(path.into(), e))?;
    let spec: ModelSpec =
        toml::from_str(&text).map_err(|e| LoadError::Spec(path.into(), one_line(&e)))?;
    spec.validate()
        .map_err(|e| LoadError::Spec(path.into(), e))?;
    Ok(spec)
}

/// Loads the final model of a kiln run directory (`model.toml` + `model.bpk`).
pub fn load_run(run_dir: &Path, device: &Device) -> Result<Classifier, LoadError> {
    let spec = read_spec(&run_dir.join(SPEC_FILE))?;
    load_classifier(&spec, &run_dir.join(WEIGHTS_FILE), device)
}

/// Builds the classifier `spec` describes and loads `weights` into it: a SafeTensors file when
/// its name ends in `.safetensors`, burnpack otherwise.
pub fn load_classifier(
    spec: &ModelSpec,
    weights: &Path,
    device: &Device,
) -> Result<Classifier, LoadError> {
    if !weights.is_file() {
        return Err(LoadError::Io(
            weights.into(),
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        ));
    }
    let model = crate::modules::with_rng(|| spec.classifier(device))
        .map_err(|e| LoadError::Spec(weights.into(), e))?;
    let is_safetensors = weights.extension().is_some_and(|e| e == "safetensors");
    if is_safetensors {
        let mut model = model;
        let mut store = SafetensorsStore::from_file(weights);
        let result = model
            .load_from(&mut store)
            .map_err(|e| LoadError::Weights(weights.into(), one_line(&e)))?;
        if !result.missing.is_empty() || !result.errors.is_empty() {
            return Err(LoadError::Weights(
                weights.into(),
                format!(
                    "{} missing tensors ({:?}), {} errors",
                    result.missing.len(),
                    result
                        .missing
                        .iter()
                        .map(|m| &m.0)
                        .take(3)
                        .collect::<Vec<_>>(),
                    result.errors.len()
                ),
            ));
        }
        Ok(model)
    } else {
        model
            .try_load_file(weights)
            .map_err(|e| LoadError::Weights(weights.into(), one_line(&e)))
    }
}

/// Loads the final model of family `M` of a kiln run directory (`model.toml` + `model.bpk`)
/// and its config: `load_family_run::<Gpt>(dir, &device)`.
pub fn load_family_run<M: Registered>(
    run_dir: &Path,
    device: &Device,
) -> Result<(M, M::Config), LoadError> {
    let spec_path = run_dir.join(SPEC_FILE);
    let spec = read_spec(&spec_path)?;
    let config = spec
        .model
        .config_of::<M>()
        .map_err(|e| LoadError::Spec(spec_path.clone(), e))?
        .clone();
    let weights = run_dir.join(WEIGHTS_FILE);
    let model = crate::modules::with_rng(|| M::init(&config, device))
        .try_load_file(&weights)
        .map_err(|e| LoadError::Weights(weights, one_line(&e)))?;
    Ok((model, config))
}

/// Loads the final language model of a kiln run directory (`model.toml` + `model.bpk`), of
/// whichever family it records.
pub fn load_lm_run(run_dir: &Path, device: &Device) -> Result<LanguageModel, LoadError> {
    let spec_path = run_dir.join(SPEC_FILE);
    let spec = read_spec(&spec_path)?;
    struct Load<'a> {
        weights: PathBuf,
        device: &'a Device,
    }
    impl FamilyVisitor for Load<'_> {
        type Output = Result<LanguageModel, LoadError>;
        fn visit<M: Registered>(self, config: &M::Config) -> Self::Output {
            let model = crate::modules::with_rng(|| M::init(config, self.device))
                .try_load_file(&self.weights)
                .map_err(|e| LoadError::Weights(self.weights.clone(), one_line(&e)))?;
            Ok(model.into_language_model())
        }
    }
    let load = Load {
        weights: run_dir.join(WEIGHTS_FILE),
        device,
    };
    spec.model.visit(load).unwrap_or_else(|| {
        Err(LoadError::Spec(
            spec_path,
            format!(
                "model.kind = {:?} is not a language model",
                crate::registry::kind_name(spec.model.kind)
            ),
        ))
    })
}

/// Writes `model` as SafeTensors to `path`.
pub fn save_safetensors<M: ModuleSnapshot>(model: &M, path: &Path) -> Result<(), LoadError> {
    let mut store = SafetensorsStore::from_file(path).overwrite(true);
    model
        .save_into(&mut store)
        .map_err(|e| LoadError::Weights(path.into(), one_line(&e)))
}

fn one_line(e: &dyn fmt::Display) -> String {
    e.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifier_flops_count_the_products_of_the_built_shapes() {
        let input = InputSpec {
            channels: 1,
            height: 28,
            width: 28,
            num_classes: 10,
        };
        let mut spec = ModelSpec {
            model: ModelSection::default(),
            input: Some(input),
        };
        // The default ConvNet: 5×5 kernels, 1→16 channels on 28², 16→32 on 14², a head from
        // 32·7² to 10; six FLOPs per multiply-add in a training step.
        let convnet = 6.0 * (16.0 * 28.0 * 28.0 * 25.0 + 16.0 * 32.0 * 14.0 * 14.0 * 25.0)
            + 6.0 * (32.0 * 7.0 * 7.0 * 10.0);
        assert_eq!(spec.classifier_flops_per_sample(), Some(convnet));
        spec.model.kind = ModelKind::Mlp;
        let mlp = 6.0 * (784.0 * 256.0 + 256.0 * 128.0 + 128.0 * 10.0);
        assert_eq!(spec.classifier_flops_per_sample(), Some(mlp));
        spec.model.kind = ModelKind::Gpt;
        assert_eq!(spec.classifier_flops_per_sample(), None);
        spec.model.kind = ModelKind::Convnet;
        spec.input = None;
        assert_eq!(spec.classifier_flops_per_sample(), None);
    }
}
