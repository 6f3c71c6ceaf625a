//! From a [`RootConfig`](crate::config::RootConfig) and a [`Workload`](crate::trainer::Workload) to a finished run: devices, the start-up table, the
//! run directory, the trainer, and the exported model. Which workload a config asks for is a
//! program's business (kiln's own: `kiln::builtin`).

mod devices;
mod eval;
mod info;
mod kept_tuning;
mod planned;
mod resume;
mod table;
mod train;
mod tuned;

pub use devices::{
    Adapter, Chosen, CudaCard, auto_choice, cuda_cards, devices_report, resolve_devices,
    wgpu_adapters,
};
pub use info::{RunInfo, RunOptions, RunResult};
pub use resume::resolve_resume;
pub use train::train_workload;
pub use tuned::Tuned;
