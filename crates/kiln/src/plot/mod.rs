//! `train plot`: PNG charts of a run's `metrics.jsonl`.
//!
//! Five charts: `loss.png` (training and validation loss against the step), `metrics.png`
//! (the step's named metrics, when it logs any), `throughput.png` (samples or tokens per
//! second, each window and smoothed, against the step), `memory.png`
//! and `utilization.png` (the system monitor's samples against the time since the start); and,
//! for a pipeline run, `schedule.png`: the last recorded flush as a timeline, one row per
//! stage and a box per micro-batch's forward or backward, the idle time left white. A
//! chart whose data the run did not record is skipped, and the caller is told why. Text is
//! drawn with a typeface compiled into the binary, so no system fonts are needed.

mod charts;
mod draw;
mod grid;
mod run;
mod timeline;

pub use charts::Outcome;
pub use grid::save_image_grid;
pub use run::{SIZE_RANGE, plot_run};
