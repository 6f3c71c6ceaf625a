//! Starting weights and what trains: a new run's model loaded from a file another run, Burn or
//! PyTorch wrote (`[init]`), checked against the model before anything is written; frozen
//! parts and LoRA adapters (`[finetune]`); the exported files (`[export]`).

mod export;
mod load;
mod peft;
mod read;
mod tune;

pub use export::{ADAPTERS_FILE, HF_DIR, export};
pub use load::{Loaded, load, resolve};
pub use peft::PEFT_DIR;
pub use read::{Stored, read_tensors};
pub use tune::{ParamInfo, apply, count_params, matches, param_infos};
