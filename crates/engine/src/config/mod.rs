//! The typed root config: one TOML file, one section per component, dotted overrides.
//!
//! Loading goes file → TOML value → `--set` overrides applied to the value → typed config, so
//! that an override of an unknown key or of the wrong type fails exactly like a bad file does,
//! with the dotted key in the message.

mod finetune;
mod hardware;
mod init;
mod names;
mod optim;
mod overrides;
mod parallel;
mod precision;
mod root;
mod train;

pub use finetune::{ExportConfig, ExportFormat, FinetuneConfig, LoraConfig, QuantBits};
pub use hardware::{
    Accelerator, CpuSplit, DeviceList, HEADROOM, HardwareConfig, MonitorConfig, SinkKind,
};
pub use init::{InitConfig, WeightsFormat};
pub use names::{name_of, one_line};
pub use optim::{
    GroupConfig, LrScaling, OptimConfig, OptimizerKind, ScheduleConfig, ScheduleKind, is_group_name,
};
pub use overrides::{Origin, apply_override, read_source, read_table, section, with_origin};
pub use parallel::{
    DdpConfig, DilocoConfig, DistConfig, Overlap, ParallelConfig, PipelineConfig, PipelineSchedule,
    StrategyConfig, StrategyKind,
};
pub use precision::{
    PrecisionConfig, PrecisionMode, RecomputeConfig, RecomputeMode, ReduceDtype, ScalerKind,
};
pub use root::RootConfig;
pub use train::{
    CheckpointFormat, HostWaits, LoaderConfig, MetricMode, MetricWatch, RunConfig, TrainConfig,
};
