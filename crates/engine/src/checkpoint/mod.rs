//! Checkpoints: `checkpoints/step-N/` directories written atomically (a temporary directory
//! renamed into place), holding the model, the optimizer state and the loop state.
//!
//! Nothing in a checkpoint depends on the strategy or the number of ranks. A gathered
//! checkpoint holds the whole model (gathered by the strategy) and the optimizer state per
//! parameter, under the parameter's module path and in its shape
//! ([`OptimState`](crate::optim::OptimState)), whatever shards it was stepped in. A sharded one
//! (`sharded.rs`, `train.checkpoint_format = "sharded"`) holds the same tensors as ranges that
//! each rank wrote of what it holds, named the same way, and any world reads back the ranges it
//! needs. Any checkpoint therefore resumes under any strategy and device count.

mod integrity;
mod manifest;
mod optimizer;
mod reader;
mod sharded;
mod store;

pub use crate::state::LoopState;
pub use integrity::{Newest, Verified, newest_whole, report, verify};
pub use manifest::{FileDigest, MODEL_FILE, OPTIM_FILE, STATE_FILE, digest};
pub use optimizer::{load_group_optimizer, load_optimizer, optim_file, save_optimizer};
pub use reader::{Sharded, is_sharded};
pub use sharded::{failed_file, index_file, note_failure, rank_file, rest_file, write_share};
pub use store::{
    BEST_FILE, Best, Score, begin_sharded, check_model, finish_sharded, latest, list, load_model,
    read_best, read_state, remove_stale, save, save_record, sharded_tmp, step_dir,
};
