//! The throughput arithmetic of the logging block: samples and tokens per second, the model
//! FLOPs utilization against the device's peak, smoothed rates and the step's time shares.

use serde_json::{Map, Value};

use crate::metrics::num;

/// Dense BF16/FP16 tensor-core peaks in TFLOP/s, from NVIDIA's datasheets, which print the
/// figures "with sparsity" (twice these): H200 SXM and H100 SXM 1,979, H100 NVL 1,671, H100
/// PCIe 1,513, L40S 733, L4 242, A100 624; V100 (no sparsity) 125. Matched against the
/// device's name, most specific first. MFU is reported against these half-precision peaks
/// whatever `precision.mode` is (the usual convention), so an f32 run's MFU is its fraction of
/// the card's bf16 tensor-core peak; `monitor.peak_tflops` sets another reference.
const KNOWN_PEAKS: [(&[&str], f64); 8] = [
    (&["H200"], 989.0),
    (&["H100", "NVL"], 835.0),
    (&["H100", "PCIe"], 756.0),
    (&["H100"], 989.0),
    (&["A100"], 312.0),
    (&["L40S"], 362.0),
    (&["L4"], 121.0),
    (&["V100"], 125.0),
];

/// Peak dense TFLOP/s of one device: `configured` when set, otherwise the table's entry for
/// the device `name` (a GPU's marketing name, e.g. `NVIDIA H100 80GB HBM3`), otherwise none.
pub fn peak_tflops(configured: Option<f64>, name: Option<&str>) -> Option<f64> {
    configured.or_else(|| {
        let name = name?;
        let words: Vec<&str> = name
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect();
        KNOWN_PEAKS
            .iter()
            .find(|(keys, _)| keys.iter().all(|k| words.contains(k)))
            .map(|&(_, peak)| peak)
    })
}

/// An exponential moving average: `smoothing` is the weight of the history.
#[derive(Debug, Clone, Copy)]
pub struct Ema {
    smoothing: f64,
    value: Option<f64>,
}

impl Ema {
    /// An empty average.
    pub fn new(smoothing: f64) -> Self {
        Self {
            smoothing,
            value: None,
        }
    }

    /// Folds `x` in and returns the average; the first value is taken as it is.
    pub fn update(&mut self, x: f64) -> f64 {
        let v = match self.value {
            Some(v) if x.is_finite() => self.smoothing * v + (1.0 - self.smoothing) * x,
            Some(v) => v,
            None => x,
        };
        self.value = Some(v);
        v
    }
}

/// The step-time split as percentages of their sum: data, compute, sync, optimizer.
pub fn split_percent(parts: [f64; 4]) -> [f64; 4] {
    let total: f64 = parts.iter().sum();
    if total > 0.0 {
        parts.map(|p| 100.0 * p / total)
    } else {
        [0.0; 4]
    }
}

/// The throughput columns of the training records: tokens, per-device rates, smoothed rates,
/// MFU and the step-time split in percent.
#[derive(Debug, Clone)]
pub struct Throughput {
    world: usize,
    tokens_per_sample: Option<f64>,
    flops_per_sample: Option<f64>,
    /// Peak FLOP/s of all devices together.
    peak_flops: Option<f64>,
    samples_ema: Ema,
    tokens_ema: Ema,
}

impl Throughput {
    /// For `world` devices of `peak_tflops` each, training a model of `flops_per_sample`
    /// (forward and backward) on samples of `tokens_per_sample` tokens.
    pub fn new(
        world: usize,
        tokens_per_sample: Option<usize>,
        flops_per_sample: Option<f64>,
        peak_tflops: Option<f64>,
        smoothing: f64,
    ) -> Self {
        Self {
            world: world.max(1),
            tokens_per_sample: tokens_per_sample.map(|t| t as f64),
            flops_per_sample,
            peak_flops: peak_tflops.map(|p| p * 1e12 * world.max(1) as f64),
            samples_ema: Ema::new(smoothing),
            tokens_ema: Ema::new(smoothing),
        }
    }

    /// Adds the columns for a window that trained `rate` samples per second — `tokens` tokens
    /// per second, where the steps' outputs counted the tokens their losses were the means
    /// over (a language model's trained targets), else `rate` × the tokens per sample — and
    /// spent `times` (data, compute, sync, optimizer) in each part of a step; returns the
    /// words the progress display adds.
    pub fn annotate(
        &mut self,
        record: &mut Map<String, Value>,
        rate: f64,
        tokens: Option<f64>,
        times: [f64; 4],
    ) -> String {
        let world = self.world as f64;
        let mut put = |k: &str, v: f64| {
            record.insert(k.to_string(), num(v));
        };
        let smooth = self.samples_ema.update(rate);
        put("samples_per_sec_ema", smooth);
        put("samples_per_sec_per_device", rate / world);
        let tokens = tokens.or(self.tokens_per_sample.map(|t| rate * t));
        let mut words = match tokens {
            Some(tokens) => {
                put("tokens_per_sec", tokens);
                let smooth = self.tokens_ema.update(tokens);
                put("tokens_per_sec_ema", smooth);
                put("tokens_per_sec_per_device", tokens / world);
                format!("{smooth:.0} tokens/s")
            }
            None => format!("{smooth:.0} samples/s"),
        };
        if let (Some(f), Some(peak)) = (self.flops_per_sample, self.peak_flops) {
            let mfu = rate * f / peak;
            put("mfu", mfu);
            words += &format!(" mfu {:.1}%", 100.0 * mfu);
        }
        let pct = split_percent(times);
        for (key, p) in ["pct_data", "pct_compute", "pct_sync", "pct_optim"]
            .iter()
            .zip(pct)
        {
            put(key, p);
        }
        words += &format!(
            " | data {:.0}% compute {:.0}% sync {:.0}% optim {:.0}%",
            pct[0], pct[1], pct[2], pct[3]
        );
        words
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_table_matches_names_most_specific_first() {
        assert_eq!(
            peak_tflops(None, Some("NVIDIA H100 80GB HBM3")),
            Some(989.0)
        );
        assert_eq!(peak_tflops(None, Some("NVIDIA H100 PCIe")), Some(756.0));
        assert_eq!(peak_tflops(None, Some("NVIDIA H100 NVL")), Some(835.0));
        assert_eq!(peak_tflops(None, Some("NVIDIA H200")), Some(989.0));
        assert_eq!(
            peak_tflops(None, Some("NVIDIA A100-SXM4-80GB")),
            Some(312.0)
        );
        assert_eq!(peak_tflops(None, Some("NVIDIA L4")), Some(121.0));
        assert_eq!(peak_tflops(None, Some("NVIDIA L40S")), Some(362.0));
        assert_eq!(peak_tflops(None, Some("AMD Ryzen 7 PRO 4750U")), None);
        assert_eq!(peak_tflops(None, None), None);
        assert_eq!(peak_tflops(Some(2.5), Some("NVIDIA H100")), Some(2.5));
    }

    #[test]
    fn ema_starts_at_the_first_value_and_weighs_history() {
        let mut e = Ema::new(0.75);
        assert_eq!(e.update(100.0), 100.0);
        assert_eq!(e.update(200.0), 125.0);
        assert_eq!(e.update(f64::NAN), 125.0);
        let mut none = Ema::new(0.0);
        none.update(1.0);
        assert_eq!(none.update(7.0), 7.0);
    }

    #[test]
    fn split_percentages_sum_to_one_hundred() {
        let p = split_percent([1.0, 6.0, 2.0, 1.0]);
        assert_eq!(p, [10.0, 60.0, 20.0, 10.0]);
        assert_eq!(split_percent([0.0; 4]), [0.0; 4]);
    }

    #[test]
    fn throughput_columns_follow_from_the_rate() {
        let mut t = Throughput::new(2, Some(64), Some(6.0e6 * 64.0), Some(1.0), 0.5);
        let mut r = Map::new();
        let words = t.annotate(&mut r, 100.0, None, [1.0, 7.0, 1.0, 1.0]);
        assert_eq!(r["tokens_per_sec"], 6400.0);
        assert_eq!(r["tokens_per_sec_per_device"], 3200.0);
        assert_eq!(r["samples_per_sec_per_device"], 50.0);
        assert_eq!(r["samples_per_sec_ema"], 100.0);
        // 100 samples/s × 3.84e8 FLOPs ÷ (2 devices × 1e12 FLOP/s)
        assert!((r["mfu"].as_f64().unwrap() - 0.0192).abs() < 1e-12);
        assert_eq!(r["pct_compute"], 70.0);
        assert!(words.contains("mfu 1.9%"), "{words}");
        t.annotate(&mut r, 200.0, None, [1.0, 1.0, 1.0, 1.0]);
        assert_eq!(r["samples_per_sec_ema"], 150.0);
        assert_eq!(r["pct_sync"], 25.0);
        let mut images = Throughput::new(1, None, None, Some(1.0), 0.5);
        let mut r = Map::new();
        images.annotate(&mut r, 10.0, None, [0.0; 4]);
        assert!(!r.contains_key("mfu") && !r.contains_key("tokens_per_sec"));
        // Tokens counted by the steps (the targets that trained) replace rate × tokens.
        let words = t.annotate(&mut r, 100.0, Some(1000.0), [1.0; 4]);
        assert_eq!(r["tokens_per_sec"], 1000.0);
        assert_eq!(r["tokens_per_sec_per_device"], 500.0);
        assert!(words.contains("tokens/s"), "{words}");
    }
}
