//! The one list of the language-model families kiln trains. A family is its module (a
//! [`Family`]) and one line in `families!` below, which makes of it a `model.kind`, a
//! `[model.<name>]` section, a [`LanguageModel`], a Hugging Face `model_type` that
//! `model.kind = "hf"` resolves to, and a case of every dispatch on the kind.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::convnet::ConvNetConfig;
use crate::family::{Family, HfNaming};
use crate::lm::{CausalLm, Sampling};
use crate::mlp::MlpConfig;

/// Something done with a `[model]` section's family, its type known: see
/// [`ModelSection::visit`].
pub trait FamilyVisitor {
    /// What it gives.
    type Output;

    /// Does it with family `M` of `config`.
    fn visit<M: Registered>(self, config: &M::Config) -> Self::Output;
}

/// A family as the list registers it: its kind, its section's name and field.
pub trait Registered: Family + 'static {
    /// Its `model.kind`.
    const KIND: ModelKind;
    /// Its `model.kind` and section name (`llama` for `[model.llama]`).
    const NAME: &'static str;
    /// Its settings in `section`.
    fn config(section: &ModelSection) -> &Self::Config;
    /// Its settings in `section`, to change.
    fn config_mut(section: &mut ModelSection) -> &mut Self::Config;
    /// The model as a [`LanguageModel`].
    fn into_language_model(self) -> LanguageModel;
}

macro_rules! families {
    ($( $(#[$doc:meta])* $kind:ident => $field:ident: $model:ty ),* $(,)?) => {
        /// Which architecture a model section describes.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(rename_all = "kebab-case")]
        pub enum ModelKind {
            /// [`ConvNet`](crate::ConvNet).
            Convnet,
            /// [`Mlp`](crate::Mlp).
            Mlp,
            $( $(#[$doc])* $kind, )*
            /// A Hugging Face checkpoint's architecture, read from the `config.json` of the
            /// directory `init.from` names (a run records the family it resolved to).
            Hf,
        }

        /// The `[model]` section of a config: the architecture and each architecture's
        /// settings.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct ModelSection {
            /// Architecture to build. Default `convnet`.
            pub kind: ModelKind,
            /// Settings used when `kind = "convnet"`.
            pub convnet: ConvNetConfig,
            /// Settings used when `kind = "mlp"`.
            pub mlp: MlpConfig,
            $(
                #[doc = concat!("Settings used when `kind = \"", stringify!($field), "\"`.")]
                pub $field: <$model as CausalLm>::Config,
            )*
        }

        impl Default for ModelSection {
            fn default() -> Self {
                Self {
                    kind: ModelKind::Convnet,
                    convnet: ConvNetConfig::default(),
                    mlp: MlpConfig::default(),
                    $( $field: Default::default(), )*
                }
            }
        }

        impl ModelSection {
            /// `visit` done with the section's family; `None` for an image model, or for
            /// `hf` before it is resolved.
            pub fn visit<V: FamilyVisitor>(&self, visit: V) -> Option<V::Output> {
                match self.kind {
                    $( ModelKind::$kind => Some(visit.visit::<$model>(&self.$field)), )*
                    ModelKind::Convnet | ModelKind::Mlp | ModelKind::Hf => None,
                }
            }

            /// The section a `config.json` describes: its family's kind and settings.
            pub fn from_hf_json(json: &Value) -> Result<ModelSection, String> {
                let model_type = json
                    .get("model_type")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        format!("key `model_type`: missing (kiln reads {})", hf_model_types())
                    })?;
                $(
                    if <$model as Family>::MODEL_TYPES.contains(&model_type) {
                        return Ok(ModelSection {
                            kind: ModelKind::$kind,
                            $field: <$model as Family>::from_hf(model_type, json)?,
                            ..ModelSection::default()
                        });
                    }
                )*
                Err(format!(
                    "key `model_type`: {model_type:?} is an architecture kiln does not have (it \
                     reads {})",
                    hf_model_types()
                ))
            }
        }

        /// The Hugging Face `model_type`s kiln reads, in words.
        fn hf_model_types() -> String {
            let all: Vec<&str> = [$( <$model as Family>::MODEL_TYPES ),*].concat();
            match all.split_last() {
                Some((last, rest)) if !rest.is_empty() => {
                    format!("{} and {last}", rest.join(", "))
                }
                _ => all.join(""),
            }
        }

        $(
            impl Registered for $model {
                const KIND: ModelKind = ModelKind::$kind;
                const NAME: &'static str = stringify!($field);
                fn config(section: &ModelSection) -> &Self::Config {
                    &section.$field
                }
                fn config_mut(section: &mut ModelSection) -> &mut Self::Config {
                    &mut section.$field
                }
                fn into_language_model(self) -> LanguageModel {
                    LanguageModel::$kind(self)
                }
            }
        )*

        /// Any of the causal language models, as a run directory holds it.
        #[derive(Debug)]
        pub enum LanguageModel {
            $( $(#[$doc])* $kind($model), )*
        }

        impl LanguageModel {
            /// `prompt` continued by `tokens` ids (see [`CausalLm::continue_ids`]).
            pub fn continue_ids(
                &self,
                prompt: &[u32],
                tokens: usize,
                how: &Sampling,
                uniform: &mut dyn FnMut() -> f64,
            ) -> Vec<u32> {
                match self {
                    $( LanguageModel::$kind(m) => m.continue_ids(prompt, tokens, how, uniform), )*
                }
            }

            /// Logits `[batch, time, vocab]` of token ids `[batch, time]`.
            pub fn logits(&self, tokens: burn::prelude::Tensor<2, burn::prelude::Int>)
                -> burn::prelude::Tensor<3> {
                match self {
                    $( LanguageModel::$kind(m) => m.logits(tokens), )*
                }
            }
        }
    };
}

families! {
    /// kiln's [`Gpt`](crate::Gpt), from the `[model.gpt]` section.
    Gpt => gpt: crate::gpt::Gpt,
    /// The [`Llama`](crate::Llama) family (Llama, Mistral, Qwen2), from the `[model.llama]`
    /// section.
    Llama => llama: crate::llama::Llama,
    /// [`Gpt2`](crate::Gpt2), from the `[model.gpt2]` section.
    Gpt2 => gpt2: crate::gpt2::Gpt2,
    /// [`Phi3`](crate::Phi3) (Phi-3, Phi-3.5, Phi-4-mini), from the `[model.phi3]` section.
    Phi3 => phi3: crate::phi3::Phi3,
}

impl ModelKind {
    /// Whether the kind is a causal language model (it trains on text).
    pub fn is_language_model(self) -> bool {
        !matches!(self, ModelKind::Convnet | ModelKind::Mlp)
    }
}

impl ModelSection {
    /// Checks the family's settings (a language model's; `Ok` for any other kind).
    pub fn validate_family(&self) -> Result<(), String> {
        struct Check;
        impl FamilyVisitor for Check {
            type Output = Result<(), String>;
            fn visit<M: Registered>(self, config: &M::Config) -> Self::Output {
                M::validate(config, &format!("model.{}", M::NAME))
            }
        }
        self.visit(Check).unwrap_or(Ok(()))
    }

    /// Whether the section's family has a Hugging Face layout (`hf` has, by its nature).
    pub fn has_hf_layout(&self) -> bool {
        struct Layout;
        impl FamilyVisitor for Layout {
            type Output = bool;
            fn visit<M: Registered>(self, _config: &M::Config) -> bool {
                !M::MODEL_TYPES.is_empty()
            }
        }
        self.kind == ModelKind::Hf || self.visit(Layout).unwrap_or(false)
    }

    /// The `config.json` `transformers` reads for the section's family, with its own
    /// `model_type`; `None` for a family with no Hugging Face layout.
    pub fn hf_json(&self) -> Option<Value> {
        struct Json;
        impl FamilyVisitor for Json {
            type Output = Option<Value>;
            fn visit<M: Registered>(self, config: &M::Config) -> Self::Output {
                M::hf_json(config)
            }
        }
        self.visit(Json).flatten()
    }

    /// How the weight files of the section's family name their tensors.
    pub fn hf_naming(&self) -> HfNaming {
        struct Naming;
        impl FamilyVisitor for Naming {
            type Output = HfNaming;
            fn visit<M: Registered>(self, config: &M::Config) -> HfNaming {
                M::hf_naming(config)
            }
        }
        self.visit(Naming).unwrap_or_default()
    }

    /// Whether the family's projections store their weight `[in, out]` (PEFT's
    /// `fan_in_fan_out`).
    pub fn conv1d_projections(&self) -> bool {
        struct Conv1d;
        impl FamilyVisitor for Conv1d {
            type Output = bool;
            fn visit<M: Registered>(self, _config: &M::Config) -> bool {
                M::CONV1D_PROJECTIONS
            }
        }
        self.visit(Conv1d).unwrap_or(false)
    }

    /// The settings of family `M`, when the section is of that kind.
    pub fn config_of<M: Registered>(&self) -> Result<&M::Config, String> {
        if self.kind == M::KIND {
            Ok(M::config(self))
        } else {
            Err(format!(
                "model.kind = {:?}, not {:?}",
                kind_name(self.kind),
                M::NAME
            ))
        }
    }
}

/// `kind` as a config names it (`gpt2`).
pub fn kind_name(kind: ModelKind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{kind:?}"))
}
