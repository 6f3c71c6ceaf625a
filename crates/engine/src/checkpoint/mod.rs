//! Checkpoints: `checkpoints/step-N/` directories written atomically (a temporary directory
//! renamed into place), holding the model, the optimizer state and the loop state.
//!
//! Nothing in a checkpoint depends on the strategy or the number of ranks: the model is the
//! whole model (gathered by the strategy), and the optimizer state is kept per parameter, under
//! the parameter's module path and in its shape ([`OptimState`](crate::optim::OptimState)), whatever shards it was
//! stepped in. Any checkpoint therefore resumes under any strategy and device count.

mod integrity;
mod manifest;
mod optimizer;
mod store;

pub use crate::state::LoopState;
pub use integrity::{Newest, Verified, newest_whole, report, verify};
pub use manifest::{FileDigest, MODEL_FILE, OPTIM_FILE, STATE_FILE, digest};
pub use optimizer::{load_group_optimizer, load_optimizer, optim_file, save_optimizer};
pub use store::{
    BEST_FILE, Best, Score, latest, list, load_model, read_best, read_state, remove_stale, save,
    save_record, step_dir,
};
