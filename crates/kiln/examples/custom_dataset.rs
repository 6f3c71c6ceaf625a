//! A dataset of one's own, written as Burn's learner wants it — a `Dataset` of items and a
//! `Batcher` — trained by kiln as it is (`kiln::BurnData`, `kiln::BurnWorkload`): two
//! interleaved half-moons of points in the plane, and a small MLP that tells them apart.
//!
//! ```text
//! cargo run --release -p kiln --example custom_dataset
//! cargo run --release -p kiln --example custom_dataset -- --devices 2 --set data.points=4000 \
//!     --set data.workers=2
//! ```

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::activation::relu;
use kiln::data::SplitMix64;
use kiln::{BlockStack, BurnData, BurnWorkload, StepOutput, TrainStep, UserConfig};
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: kiln::Allocator = kiln::Allocator;

const RECIPE: &str = r#"
[run]
name = "moons"

[data]
points = 2000
noise = 0.15

[train]
epochs = 3
batch_size = 32
log_every = 20

[optim]
name = "adamw"
lr = 0.01
"#;

/// `[model]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ModelConfig {
    /// Width of the two hidden layers.
    hidden: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self { hidden: 32 }
    }
}

/// `[data]`: how many points, and how far they stray from their moon.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct DataConfig {
    /// Points in all (a fifth of them evaluate).
    points: usize,
    /// The largest offset of a point from its moon, in each coordinate.
    noise: f32,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            points: 1000,
            noise: 0.1,
        }
    }
}

/// One point and its moon.
#[derive(Debug, Clone)]
struct Point {
    xy: [f32; 2],
    moon: u8,
}

/// The moons, made from a seed: item `i` is the same whoever asks for it.
struct Moons {
    offset: usize,
    len: usize,
    noise: f32,
}

impl Dataset<Point> for Moons {
    fn get(&self, index: usize) -> Result<Point, DatasetError> {
        if index >= self.len {
            return Err(DatasetError::new(std::io::Error::other(format!(
                "point {index} of {}",
                self.len
            ))));
        }
        let mut rng = SplitMix64::new(0x6d6f_6f6e ^ (self.offset + index) as u64);
        let moon = (rng.next_u32() % 2) as u8;
        let angle = rng.next_f32() * std::f32::consts::PI;
        let (x, y) = if moon == 0 {
            (angle.cos(), angle.sin())
        } else {
            (1.0 - angle.cos(), 0.5 - angle.sin())
        };
        let mut jitter = || (rng.next_f32() * 2.0 - 1.0) * self.noise;
        Ok(Point {
            xy: [x + jitter(), y + jitter()],
            moon,
        })
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// A batch of points.
#[derive(Debug, Clone)]
struct Points {
    xy: Tensor<2>,
    moons: Tensor<1, Int>,
}

/// Items into tensors on the rank's device.
#[derive(Clone, Default)]
struct PointBatcher;

impl Batcher<Point, Points> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &Device) -> Points {
        let n = items.len();
        let xy: Vec<f32> = items.iter().flat_map(|p| p.xy).collect();
        let moons: Vec<i64> = items.iter().map(|p| i64::from(p.moon)).collect();
        Points {
            xy: Tensor::from_data(TensorData::new(xy, [n, 2]), device),
            moons: Tensor::from_data(TensorData::new(moons, [n]), device),
        }
    }
}

/// Three linear layers.
#[derive(Module, Debug)]
struct Mlp {
    a: Linear,
    b: Linear,
    out: Linear,
}

impl TrainStep<Points> for Mlp {
    fn step(&self, batch: Points) -> StepOutput {
        let x = relu(self.b.forward(relu(self.a.forward(batch.xy))));
        // Cross-entropy and the count of right answers, as kiln's own classifiers give them.
        kiln_models::classification_output(self.out.forward(x), batch.moons)
    }
}

impl BlockStack<Points> for Mlp {}

fn main() {
    kiln::App::new(
        "custom_dataset",
        "Two moons: a Burn Dataset and Batcher trained by kiln",
    )
    .recipe(RECIPE)
    .main(|config: &UserConfig<ModelConfig, DataConfig>| {
        let d = &config.data;
        if d.points < 10 {
            return Err(kiln::Error::config(format!(
                "key `data.points`: at least 10 points, got {}",
                d.points
            )));
        }
        let eval = d.points / 5;
        let train = Moons {
            offset: 0,
            len: d.points - eval,
            noise: d.noise,
        };
        let test = Moons {
            offset: d.points - eval,
            len: eval,
            noise: d.noise,
        };
        let hidden = config.model.hidden;
        let data = BurnData::new(train, test, PointBatcher);
        Ok(BurnWorkload::new(data, move |device| Mlp {
            a: LinearConfig::new(2, hidden).init(device),
            b: LinearConfig::new(hidden, hidden).init(device),
            out: LinearConfig::new(hidden, 2).init(device),
        })
        .with_cast(|b: Points, dtype| Points {
            xy: b.xy.cast(dtype),
            ..b
        }))
    })
}
