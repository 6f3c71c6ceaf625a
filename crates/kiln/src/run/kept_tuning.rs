//! Where CubeCL, the runtime under Burn's GPU backends (CUDA, WGPU), keeps what it learns
//! between runs — autotune's choice of kernel for each shape, and compiled kernels — so that a
//! second run on the same card does not tune again: kiln's cache folder, beside the planner's
//! kept measurements.

use std::path::{Path, PathBuf};

use burn::cubecl::config::cache::CacheConfig;
use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// The folder under kiln's cache folder (`$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else
/// `~/.cache/kiln`) where CubeCL keeps its results; `None` without a cache folder.
pub(crate) fn folder() -> Option<PathBuf> {
    crate::plan::cache_folder().map(|d| d.join("cubecl"))
}

/// Points CubeCL's kept results at `dir`, unless a `cubecl.toml` or `burn.toml` above the
/// working directory names a place of its own, or CubeCL's configuration was already read
/// (its first use fixes it for the process). The configuration otherwise stays as CubeCL
/// reads it (its files, then its `CUBECL_*` variables). Says whether it set the place.
pub(crate) fn keep_tuning_in(dir: &Path) -> bool {
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if !matches!(config.environment.path, CacheConfig::Target) {
        return false;
    }
    config.environment.path = CacheConfig::Directory(dir.to_path_buf());
    CubeClRuntimeConfig::try_set(config)
}
