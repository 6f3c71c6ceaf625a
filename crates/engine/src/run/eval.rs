//! `train eval`: the starting model of a run's settings (`init.from`: a run, an exported file,
//! a PyTorch state dict) on the config's validation set, on the configured devices and
//! strategy — a run of no steps, in a directory of its own that is removed afterwards.

use crate::error::{Error, Result};
use crate::trainer::{Checked, TrainerSettings, Workload, fit_checked};

use super::info::RunResult;

/// Evaluates `workload`'s starting model as `settings` place it, printing the loss and
/// metrics (on process 0 when `verbose`); nothing is left on disk.
pub(super) fn evaluate<W: Workload>(
    workload: &W,
    mut settings: TrainerSettings,
    checked: Checked,
    verbose: bool,
) -> Result<RunResult> {
    if workload.eval_len() == 0 {
        return Err(Error::data(
            "train eval: the config's data has no validation set (its validation part is empty)"
                .to_string(),
        ));
    }
    // Every process evaluates in a directory of its own: the run writes its (empty) metrics
    // and the final checkpoint of a run there.
    let dir = std::env::temp_dir().join(format!(
        "kiln-eval-{}-{}",
        std::process::id(),
        settings.parallel.processes.index
    ));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    settings.output.run_dir = dir.clone();
    settings.output.progress = false;
    settings.output.resume_from = None;
    settings.train.epochs = 0;
    settings.train.max_steps = Some(0);
    let outcome = fit_checked(workload, &settings, checked);
    let _ = std::fs::remove_dir_all(&dir);
    let (summary, _model) = outcome?;
    if verbose {
        let acc = summary.val_accuracy.map_or(String::new(), |a| {
            format!(", val accuracy {:.2}%", a * 100.0)
        });
        say!(
            "eval: val loss {}{acc} on {} validation samples, {} device{} ({})",
            summary
                .val_loss
                .map_or("n/a".to_string(), |l| format!("{l:.6}")),
            workload.eval_len(),
            summary.devices,
            if summary.devices == 1 { "" } else { "s" },
            summary.strategy
        );
    }
    Ok(RunResult {
        dir: settings.output.run_dir,
        summary,
        evaluated: true,
    })
}
