//! The planner: what fits and what is fastest, before a run. For the configured model, data,
//! devices and processes it weighs every strategy × precision × recompute × micro-batch that
//! gives the run's samples per step (`candidates.rs`), measures what no formula knows — the
//! model's step bytes and seconds on the real backend at two micro-batches per precision and
//! recompute mode (`probe.rs`; which two, and under a limit only those whose probe fits:
//! `rungs.rs`), the collectives on the run's ranks (`links.rs`) — and predicts
//! each candidate's memory per device and process and its step time (`predict.rs`).
//! The measurements are kept between launches (`kept.rs`), so that a command near a memory
//! limit is decided the same way every time, and dropped after a run whose peak was above
//! their prediction by more than the headroom. `train plan` prints the table (`report.rs`); a
//! run records its own prediction in
//! `summary.json`, is refused when it needs more than `hardware.memory_limit_mib`, and
//! `--strategy auto` runs the fastest plan that fits.

mod candidates;
mod kept;
mod links;
mod planner;
mod predict;
mod probe;
mod report;
mod rungs;

pub(crate) use kept::folder as cache_folder;
pub use kept::{Keeping, check_kept};
pub use links::Links;
pub(crate) use planner::is_auto;
pub use planner::{HEADROOM, Plan, Scope, Target, plan};
pub use predict::{Fit, Measured, Prediction};
pub use probe::Point;
pub use report::Choice;
