//! The planner in a run: `train plan` prints it, `--strategy auto` on several ranks runs its
//! fastest plan that fits, and every run records its own plan and is refused when that plan
//! needs more than its memory limit.

use crate::config::RootConfig;
use crate::error::Result;
use crate::metrics::{PlanRecord, Summary};
use crate::plan::{Choice, Scope, Target, plan};
use crate::trainer::Workload;

use super::info::RunResult;

/// `train plan`: every candidate's prediction, as a table or (`json`) as JSON, on process 0.
pub(super) fn print<W: Workload>(
    workload: &W,
    config: &RootConfig,
    target: &Target,
    json: bool,
) -> Result<RunResult> {
    let (devices, accelerator) = (target.devices, target.accelerator);
    let all = plan(workload, config, target, Scope::All)?;
    if crate::comm::processes().index == 0 {
        if json {
            println!(
                "{}",
                serde_json::to_string_pretty(&all).expect("a plan serialises")
            );
        } else {
            let processes = crate::comm::processes().count;
            let title = format!(
                "{} device{} of {accelerator}{}",
                devices.len(),
                if devices.len() == 1 { "" } else { "s" },
                if processes > 1 {
                    format!(" × {processes} processes")
                } else {
                    String::new()
                }
            );
            all.print(&title);
        }
    }
    Ok(RunResult {
        dir: config.run_dir(),
        summary: Summary::default(),
        evaluated: true,
    })
}

/// Under `--strategy auto` on several ranks: `ddp` as asked where it fits, else the planner's
/// fastest plan that does (in the config's precision); its config, the start-up table's words
/// and its prediction. `None` for any other strategy or one rank. `buffers`: the model has
/// BatchNorm statistics (its micro-batch stays as asked).
fn auto<W: Workload>(
    workload: &W,
    config: &RootConfig,
    target: &Target,
    buffers: bool,
) -> Result<Option<Choice>> {
    let world = target.devices.len() * crate::comm::processes().count;
    if !crate::plan::is_auto(config) || world < 2 {
        return Ok(None);
    }
    // The plan asked first (one probe): where it fits, it runs.
    let asked = plan(workload, config, target, Scope::Own)?;
    if let Some(choice) = asked.asked_fits(config) {
        return Ok(Some(choice));
    }
    let all = plan(workload, config, target, Scope::SamePrecision)?;
    all.choose(config, buffers).map(Some)
}

/// What a run trains with, as [`settle`] decides it.
pub(super) struct Settled {
    /// The config `--strategy auto` chose; `None`: the config as given.
    pub config: Option<RootConfig>,
    /// Whether the chosen config is another plan than the one the settings were made for
    /// (`auto` as the world resolves it): its settings are made and checked again.
    pub remade: bool,
    /// The plan the run records in its summary (none for an evaluation).
    pub record: Option<PlanRecord>,
    /// The start-up table's `plan` row, under `auto`.
    pub words: Option<String>,
}

/// The plan a run trains with: under `--strategy auto` on several ranks, [`auto`]'s choice;
/// otherwise the config's own plan, refused over its limit ([`own`]); nothing for an
/// evaluation. `buffers`: the model has BatchNorm statistics.
pub(super) fn settle<W: Workload>(
    workload: &W,
    config: &RootConfig,
    target: &Target,
    buffers: bool,
    evaluate: bool,
) -> Result<Settled> {
    let mut settled = Settled {
        config: None,
        remade: false,
        record: None,
        words: None,
    };
    if evaluate {
        return Ok(settled);
    }
    match auto(workload, config, target, buffers)? {
        Some(choice) => {
            let mut resolved = config.clone();
            let world = target.devices.len() * crate::comm::processes().count;
            resolved.strategy.name = resolved.strategy_on(world);
            settled.remade = choice.config != resolved;
            settled.config = Some(choice.config);
            settled.record = Some(choice.record);
            settled.words = Some(choice.words);
        }
        None => settled.record = own(workload, config, target)?,
    }
    Ok(settled)
}

/// The plan of the config as it is, for its summary; refused when it needs more than the
/// memory limit, naming the fastest plan that fits.
fn own<W: Workload>(
    workload: &W,
    config: &RootConfig,
    target: &Target,
) -> Result<Option<PlanRecord>> {
    // The run's own devices: the target's are the user's (the core split is the planner's).
    let mine = plan(workload, config, target, Scope::Own)?;
    if mine.over_limit(config) {
        let all = plan(workload, config, target, Scope::All)?;
        return Err(mine.refusal(config, &all));
    }
    Ok(mine.record())
}
