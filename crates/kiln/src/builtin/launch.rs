//! What every built-in workload's run shares: its model spec written beside its files.

use std::path::Path;

use kiln_models::ModelSpec;
use kiln_models::load::SPEC_FILE;

use super::config::Config;
use kiln_engine::config::name_of;
use kiln_engine::error::Result;
use kiln_engine::files::write_atomic;
use kiln_engine::run::{RunInfo, RunOptions, RunResult, train_workload};
use kiln_engine::trainer::Workload;

/// A built-in workload's run: its model spec (`model.toml`) beside the workload's own files.
pub(super) fn launch<W>(
    config: &Config,
    options: &RunOptions,
    workload: &W,
    spec: &ModelSpec,
    rows: Vec<(&str, String)>,
    save_extra: impl FnOnce(&Path) -> Result<()>,
) -> Result<RunResult>
where
    W: Workload,
    W::Model: burn::store::ModuleSnapshot,
{
    let info = RunInfo {
        model: name_of(&config.model.kind),
        rows: rows.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        sections: config.sections(),
        drop_last: config.data.drop_last,
    };
    train_workload(&config.kiln, options, workload, info, |dir| {
        write_atomic(
            &dir.join(SPEC_FILE),
            toml::to_string_pretty(spec)
                .expect("spec serialises")
                .as_bytes(),
        )?;
        save_extra(dir)
    })
}
