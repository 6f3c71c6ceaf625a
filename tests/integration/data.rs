//! Data from disk and from Burn: loader workers that give the same bits as the rank's own
//! thread, image folders (and their errors), and a Burn `Dataset` + `Batcher` trained as they
//! are.

use std::path::Path;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError, InMemDataset};
use burn::prelude::*;
use kiln::builtin::train;
use kiln::run::RunOptions;
use kiln::trainer::parameter_values;
use kiln::{BurnData, BurnWorkload, RunInfo, train_workload};
use kiln_models::{ImageBatch, InputSpec, ModelSection, ModelSpec, load_run};

use crate::common::{
    assert_one_line_error, max_relative_diff, small_config, temp_dir, train_bin, train_losses,
};

/// The embedded digits as an image folder: 400 training and 100 test images.
fn digits_folder(name: &str) -> crate::common::TestDir {
    let root = temp_dir(name);
    kiln_datasets::folder::write_folder(
        &kiln_datasets::digits(),
        &root,
        None,
        kiln_datasets::folder::Format::Png,
        400,
        100,
    )
    .unwrap();
    root
}

fn folder_overrides(root: &Path, extra: &[&str]) -> Vec<String> {
    let mut o = vec![
        "data.dataset=\"image-folder\"".to_string(),
        format!("data.dir={:?}", root.display().to_string()),
        "data.augment=true".to_string(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    o
}

fn run_folder(run: &Path, root: &Path, extra: &[&str]) -> (Vec<(u64, u64)>, Vec<Vec<f32>>) {
    let o = folder_overrides(root, extra);
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    let result = train(&small_config(run, &o), &RunOptions::default()).unwrap();
    let model = load_run(&result.dir, &Device::flex()).unwrap();
    (train_losses(&result.dir), parameter_values(&model))
}

#[test]
fn loader_workers_give_the_same_bits_and_resume_mid_epoch() {
    let root = digits_folder("workers");
    let dir = temp_dir("workers-runs");
    // 400 images, 16 a step: 25 steps an epoch; 30 steps cross into the second epoch, and the
    // loader builds across the boundary.
    for (devices, batch, accumulate) in [(1, 16, 1), (2, 4, 2)] {
        let common = [
            format!("hardware.devices={devices}"),
            format!("train.batch_size={batch}"),
            format!("train.accumulate={accumulate}"),
            "train.max_steps=30".to_string(),
            "train.epochs=2".to_string(),
            "train.checkpoint_every=11".to_string(),
            "train.keep_checkpoints=5".to_string(),
        ];
        let mut runs = Vec::new();
        for workers in [0, 1, 3] {
            let mut extra: Vec<String> = common.to_vec();
            extra.push(format!("data.workers={workers}"));
            extra.push("data.prefetch=2".to_string());
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            let run = dir.join(format!("d{devices}-w{workers}"));
            runs.push((run.clone(), run_folder(&run, &root, &extra)));
        }
        let (_, (losses, params)) = &runs[0];
        assert_eq!(losses.len(), 30);
        for (run, (l, p)) in &runs[1..] {
            assert_eq!(
                l,
                losses,
                "{}: losses differ from workers = 0",
                run.display()
            );
            assert_eq!(
                p,
                params,
                "{}: parameters differ from workers = 0",
                run.display()
            );
        }

        // Resume mid-epoch (step 11 of 25) with 3 workers: the same bits as the whole run.
        let cut = dir.join(format!("d{devices}-cut"));
        let resumed =
            crate::training::resume_cut(&runs[0].0, &cut, 11, &["data.workers=3".to_string()]);
        assert_eq!(&train_losses(&resumed.dir), losses);
        let model = load_run(&resumed.dir, &Device::flex()).unwrap();
        assert_eq!(&parameter_values(&model), params);
    }
}

#[test]
fn an_image_folder_trains_the_convnet_and_its_faults_are_one_line() {
    let root = digits_folder("folder");
    let dir = temp_dir("folder-runs");
    // The digits as PNGs learn as the embedded digits do.
    let o = folder_overrides(
        &root,
        &[
            "train.max_steps=100000",
            "train.epochs=6",
            "data.workers=2",
            // Flipped digits are other digits.
            "data.augment=false",
        ],
    );
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    let result = train(&small_config(&dir.join("ok"), &o), &RunOptions::default()).unwrap();
    let accuracy = result.summary.val_accuracy.unwrap();
    assert!(accuracy > 0.8, "accuracy {accuracy}");
    let config = std::fs::read_to_string(result.dir.join("config.toml")).unwrap();
    assert!(config.contains("workers = 2"), "{config}");

    // A truncated image, met by a loader thread in the middle of an epoch, ends the run with
    // one line naming it.
    let bad = root.join("train/3");
    let victim = std::fs::read_dir(&bad)
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap();
    let bytes = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &bytes[..bytes.len() / 2]).unwrap();
    let cwd = temp_dir("folder-cli");
    let root_s = root.display().to_string();
    let args = |workers: &str| {
        vec![
            "--set".to_string(),
            "data.dataset=\"image-folder\"".to_string(),
            "--set".to_string(),
            format!("data.dir={root_s:?}"),
            "--set".to_string(),
            format!("data.workers={workers}"),
            "--set".to_string(),
            "model.convnet.channels=[4, 8]".to_string(),
            "--max-steps".to_string(),
            "60".to_string(),
            "--batch-size".to_string(),
            "16".to_string(),
        ]
    };
    let name = victim.file_name().unwrap().to_str().unwrap().to_string();
    for workers in ["0", "2"] {
        let a = args(workers);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let out = train_bin(&cwd, &a);
        assert_one_line_error(&out, &[&name, "cannot decode"]);
    }
    std::fs::write(&victim, &bytes).unwrap();

    // An empty class folder, and a folder with no class folders: refused before anything is
    // written.
    let cwd = temp_dir("folder-refused");
    std::fs::create_dir_all(root.join("train/class-empty")).unwrap();
    let a = args("0");
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let out = train_bin(&cwd, &a);
    assert_one_line_error(&out, &["class-empty", "holds no images"]);
    std::fs::remove_dir(root.join("train/class-empty")).unwrap();
    let empty = temp_dir("folder-empty");
    std::fs::create_dir_all(empty.join("train")).unwrap();
    std::fs::create_dir_all(empty.join("test")).unwrap();
    let out = train_bin(
        &cwd,
        &[
            "--set",
            "data.dataset=\"image-folder\"",
            "--set",
            &format!("data.dir={:?}", empty.display().to_string()),
        ],
    );
    assert_one_line_error(&out, &["train", "no class folders"]);
    assert!(
        !cwd.join("runs").exists(),
        "a refused run wrote a run directory"
    );
}

/// A sample as a Burn example writes it.
#[derive(Debug, Clone)]
struct DigitItem {
    pixels: [f32; 64],
    label: u8,
}

/// A batcher as Burn's examples write it: one tensor per item, then one concatenation.
#[derive(Clone, Default)]
struct DigitBatcher;

impl Batcher<DigitItem, ImageBatch> for DigitBatcher {
    fn batch(&self, items: Vec<DigitItem>, device: &Device) -> ImageBatch {
        let images = items
            .iter()
            .map(|item| TensorData::new(item.pixels.to_vec(), [1, 1, 8, 8]))
            .map(|data| Tensor::<4>::from_data(data, device))
            .collect();
        let targets = items
            .iter()
            .map(|item| Tensor::<1, Int>::from_data([i64::from(item.label)], device))
            .collect();
        ImageBatch {
            images: Tensor::cat(images, 0),
            targets: Tensor::cat(targets, 0),
        }
    }
}

fn digit_items(set: &kiln_datasets::ImageDataset) -> Vec<DigitItem> {
    (0..set.len())
        .map(|i| {
            let mut pixels = [0.0; 64];
            for (p, &v) in pixels.iter_mut().zip(set.image(i)) {
                *p = f32::from(v) / f32::from(set.max_value);
            }
            DigitItem {
                pixels,
                label: set.label(i),
            }
        })
        .collect()
}

/// A dataset of one's own around Burn's: a random shift of the digit by one pixel, drawn from
/// kiln's per-sample random numbers.
struct Shifted(InMemDataset<DigitItem>);

impl Dataset<DigitItem> for Shifted {
    fn get(&self, index: usize) -> Result<DigitItem, DatasetError> {
        let mut item = self.0.get(index)?;
        let shift = kiln::sample_rng(index).index(3) as isize - 1;
        let before = item.pixels;
        for y in 0..8 {
            for x in 0..8isize {
                let sx = x - shift;
                item.pixels[y * 8 + x as usize] = if (0..8).contains(&sx) {
                    before[y * 8 + sx as usize]
                } else {
                    0.0
                };
            }
        }
        Ok(item)
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

#[test]
fn a_burn_dataset_and_batcher_train_on_two_devices_as_on_one() {
    let digits = kiln_datasets::digits();
    let spec = ModelSpec {
        // An MLP: BatchNorm's batch statistics would differ between 2 × 8 and 16 samples.
        model: ModelSection {
            kind: kiln_models::ModelKind::Mlp,
            ..ModelSection::default()
        },
        input: Some(InputSpec {
            channels: 1,
            height: 8,
            width: 8,
            num_classes: 10,
        }),
    };
    let workload = || {
        let data = BurnData::new(
            Shifted(InMemDataset::new(digit_items(&digits.train))),
            InMemDataset::new(digit_items(&digits.test)),
            DigitBatcher,
        );
        let spec = spec.clone();
        BurnWorkload::new(data, move |device| spec.classifier(device).unwrap()).with_cast(
            |b: ImageBatch, dtype| ImageBatch {
                images: b.images.cast(dtype),
                ..b
            },
        )
    };
    let dir = temp_dir("burn-data");
    let run = |name: &str, extra: &[&str]| {
        let mut o = vec!["train.max_steps=40", "optim.lr=0.01", "data.workers=2"];
        o.extend(extra);
        let config = small_config(&dir.join(name), &o);
        let info = RunInfo {
            model: "convnet".into(),
            ..RunInfo::default()
        };
        let result = train_workload(
            &config.kiln,
            &RunOptions::default(),
            &workload(),
            info,
            |_| Ok(()),
        )
        .unwrap();
        let model =
            kiln::checkpoint::load_model(&result.dir, spec.classifier(&Device::flex()).unwrap())
                .unwrap();
        (result, parameter_values(&model))
    };
    let (one, p1) = run("one", &["train.batch_size=16"]);
    let (two, p2) = run(
        "two",
        &[
            "train.batch_size=8",
            "hardware.devices=2",
            "strategy.name=\"ddp\"",
        ],
    );
    assert_eq!(two.summary.strategy, "ddp");
    let diff = max_relative_diff(&p2, &p1);
    assert!(diff <= 1e-5, "ddp vs one device: {diff}");
    let accuracy = two.summary.val_accuracy.unwrap();
    assert!(accuracy > 0.7, "accuracy {accuracy}");
    let l = train_losses(&one.dir);
    assert!(f64::from_bits(l[39].1) < f64::from_bits(l[0].1));
}

#[test]
fn a_csv_table_trains_the_mlp_and_a_bad_cell_is_one_line() {
    let dir = temp_dir("csv");
    let digits = kiln_datasets::digits();
    let mut text = (0..64)
        .map(|i| format!("p{i}"))
        .collect::<Vec<_>>()
        .join(",")
        + ",digit\n";
    for set in [&digits.train, &digits.test] {
        for i in 0..set.len() {
            let row: Vec<String> = set.image(i).iter().map(|p| p.to_string()).collect();
            text += &format!("{},{}\n", row.join(","), set.label(i));
        }
    }
    let csv = dir.join("digits.csv");
    std::fs::write(&csv, &text).unwrap();
    let path = format!("data.path={:?}", csv.display().to_string());
    let o = [
        "data.dataset=\"csv\"",
        &path,
        "data.target=\"digit\"",
        "data.workers=1",
        "model.kind=\"mlp\"",
        "train.max_steps=100000",
        "train.epochs=4",
        "train.batch_size=32",
    ];
    let result = train(&small_config(&dir.join("run"), &o), &RunOptions::default()).unwrap();
    let accuracy = result.summary.val_accuracy.unwrap();
    assert!(accuracy > 0.85, "accuracy {accuracy}");

    // A cell that is not a number, a missing target column, and a convnet: one line each.
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, text.replacen("\n0,", "\nzero,", 1)).unwrap();
    let cwd = temp_dir("csv-cli");
    for (file, set, needles) in [
        (
            &bad,
            "data.target=\"digit\"",
            vec!["bad.csv", "line", "\"zero\" is not a finite number"],
        ),
        (
            &csv,
            "data.target=\"label\"",
            vec!["digits.csv", "no column `label`"],
        ),
    ] {
        let path = format!("data.path={:?}", file.display().to_string());
        let args = [
            "--set",
            "data.dataset=\"csv\"",
            "--set",
            &path,
            "--set",
            set,
            "--set",
        ];
        let mut args = args.to_vec();
        args.push("model.kind=\"mlp\"");
        let out = train_bin(&cwd, &args);
        assert_one_line_error(&out, &needles);
    }
    let out = train_bin(&cwd, &["--set", "data.dataset=\"csv\"", "--set", &path]);
    assert_one_line_error(&out, &["model.kind", "mlp"]);
}

/// Fashion-MNIST written as 70,000 PNGs (28×28, one folder per class) trains the built-in
/// ConvNet through `data.dataset = "image-folder"` with a loader worker to at least 85 % test
/// accuracy in one epoch. It needs `cargo xtask fetch-data fashion-mnist` (Debian's
/// dataset-fashion-mnist) and about a minute and a half; CI runs it with `--ignored`.
#[test]
#[ignore = "needs data/fashion-mnist (cargo xtask fetch-data fashion-mnist); CI runs it"]
fn fashion_mnist_as_an_image_folder_reaches_85_percent() {
    let idx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/fashion-mnist");
    assert!(
        idx.is_dir(),
        "{} is missing: run `cargo xtask fetch-data fashion-mnist`",
        idx.display()
    );
    let splits = kiln_datasets::IdxKind::FashionMnist.load(&idx).unwrap();
    let root = temp_dir("fashion-folder");
    let written = kiln_datasets::folder::write_folder(
        &splits,
        &root,
        None,
        kiln_datasets::folder::Format::Png,
        usize::MAX,
        usize::MAX,
    )
    .unwrap();
    assert_eq!(written, 70_000);
    let dir = format!("data.dir={:?}", root.display().to_string());
    let o = [
        "data.dataset=\"image-folder\"",
        &dir,
        "data.workers=1",
        "model.convnet.channels=[16, 32]",
        "train.batch_size=64",
        "train.max_steps=100000",
        "train.epochs=1",
        "train.log_every=100",
    ];
    let run = temp_dir("fashion-run");
    let result = train(&small_config(&run, &o), &RunOptions::default()).unwrap();
    let accuracy = result.summary.val_accuracy.unwrap();
    assert!(accuracy >= 0.85, "test accuracy {accuracy}");
    assert_eq!(result.summary.steps, 938);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn text_read_from_disk_trains_as_text_held_in_memory() {
    let dir = temp_dir("text-disk");
    let text = crate::gpt::text_file(&dir);
    let run = |name: &str, extra: &[&str]| {
        let config = crate::gpt::gpt_config(&dir.join(name), &text, extra);
        let result = train(&config, &RunOptions::default()).unwrap();
        (train_losses(&result.dir), result.summary.val_loss)
    };
    let memory = run("memory", &[]);
    let disk = run("disk", &["data.on_disk=true", "data.workers=2"]);
    assert_eq!(disk, memory);
    let cache = kiln::builtin::text::token_file(&text);
    assert!(cache.is_file(), "no token file at {}", cache.display());
    // A second run reuses the token file; one cut short is written again.
    let bytes = std::fs::read(&cache).unwrap();
    assert_eq!(run("again", &["data.on_disk=true"]), memory);
    std::fs::write(&cache, &bytes[..bytes.len() - 1]).unwrap();
    assert_eq!(run("cut", &["data.on_disk=true"]), memory);
    assert_eq!(std::fs::read(&cache).unwrap(), bytes);
}

#[test]
fn a_stuck_or_failing_loader_thread_ends_the_run_with_one_line() {
    let dir = temp_dir("loader-faults");
    for (fault, needles) in [
        (
            "0:5:loader-panic",
            vec![
                "rank 0's data loader failed building step 5 (a panic)",
                "injected loader failure",
            ],
        ),
        (
            "0:5:loader-hang",
            vec![
                "waited 2 s (dist.timeout_s)",
                "batch of step 5",
                "data loader",
            ],
        ),
    ] {
        let run = dir.join(fault.replace(':', "-"));
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
            .args(["--max-steps", "40", "--batch-size", "16", "--run-dir"])
            .arg(&run)
            .args(["--set", "data.workers=2", "--set", "dist.timeout_s=2"])
            .env(kiln::trainer::FAULT_VAR, fault)
            // RUST_BACKTRACE asks for the whole panic report besides the one line.
            .env_remove("RUST_BACKTRACE")
            .current_dir(&dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (out, took) = crate::common::finish_within(child, std::time::Duration::from_secs(30));
        assert!(took.as_secs() < 15, "{fault}: took {took:?}");
        assert_one_line_error(&out, &needles);
    }
}

/// A regression of one's own on a CSV table: one linear layer, mean squared error.
#[derive(burn::module::Module, Debug)]
struct Line {
    linear: burn::nn::Linear,
}

/// Rows of a table as a batch.
#[derive(Debug, Clone)]
struct Rows {
    x: Tensor<2>,
    y: Tensor<2>,
}

impl kiln::TrainStep<Rows> for Line {
    fn step(&self, batch: Rows) -> kiln::StepOutput {
        let samples = batch.y.dims()[0];
        let error = self.linear.forward(batch.x) - batch.y;
        let loss = (error.clone() * error).mean().reshape([1]);
        kiln::StepOutput::new(loss, samples)
    }
}

impl kiln::BlockStack<Rows> for Line {}

struct Regression {
    train: kiln_datasets::table::Table,
    eval: kiln_datasets::table::Table,
}

impl Regression {
    fn rows(table: &kiln_datasets::table::Table, rows: &[usize], device: &Device) -> Rows {
        let x: Vec<f32> = rows.iter().flat_map(|&r| table.row(r)).copied().collect();
        let y: Vec<f32> = rows.iter().map(|&r| table.targets[r]).collect();
        let n = rows.len();
        Rows {
            x: Tensor::from_data(TensorData::new(x, [n, table.width()]), device),
            y: Tensor::from_data(TensorData::new(y, [n, 1]), device),
        }
    }
}

impl kiln::Workload for Regression {
    type Model = Line;
    type Batch = Rows;

    fn init_model(&self, device: &Device) -> Line {
        Line {
            linear: burn::nn::LinearConfig::new(self.train.width(), 1).init(device),
        }
    }
    fn train_len(&self) -> usize {
        self.train.len()
    }
    fn train_batch(&self, indices: &[usize], device: &Device) -> Rows {
        Self::rows(&self.train, indices, device)
    }
    fn eval_len(&self) -> usize {
        self.eval.len()
    }
    fn eval_batch(&self, range: std::ops::Range<usize>, device: &Device) -> Rows {
        Self::rows(&self.eval, &range.collect::<Vec<_>>(), device)
    }
    fn cast_batch(&self, batch: Rows, dtype: burn::tensor::FloatDType) -> Rows {
        Rows {
            x: batch.x.cast(dtype),
            ..batch
        }
    }
}

#[test]
fn a_regression_of_ones_own_trains_on_a_csv_table() {
    let dir = temp_dir("regression");
    // y = 2a − b + 0.5c + 1, exactly; a, b, c in [−1, 1].
    let mut rng = kiln_datasets::rng::SplitMix64::new(5);
    let mut text = "a,b,c,y\n".to_string();
    for _ in 0..600 {
        let [a, b, c] = [0; 3].map(|_| rng.next_f32() * 2.0 - 1.0);
        text += &format!("{a},{b},{c},{}\n", 2.0 * a - b + 0.5 * c + 1.0);
    }
    let path = dir.join("line.csv");
    std::fs::write(&path, text).unwrap();
    let table = kiln_datasets::table::Table::read_csv(&path, "y", &[]).unwrap();
    assert_eq!(table.features, ["a", "b", "c"]);
    let workload = Regression {
        train: table.subset(&(0..500).collect::<Vec<_>>()),
        eval: table.subset(&(500..600).collect::<Vec<_>>()),
    };
    let config = small_config(
        &dir.join("run"),
        &[
            "train.max_steps=300",
            "train.epochs=20",
            "optim.lr=0.05",
            "hardware.devices=2",
            "data.workers=1",
        ],
    );
    let info = RunInfo {
        model: "line".into(),
        ..RunInfo::default()
    };
    let result = train_workload(
        &config.kiln,
        &RunOptions::default(),
        &workload,
        info,
        |_| Ok(()),
    )
    .unwrap();
    let val = result.summary.val_loss.unwrap();
    assert!(val < 1e-3, "validation mean squared error {val}");
    assert_eq!(result.summary.devices, 2);
}
