//! Where CubeCL, the runtime under Burn's GPU backends (CUDA, WGPU), keeps what it learns
//! between runs — autotune's choice of kernel for each shape, and compiled kernels — so that a
//! second run on the same card does not tune again: kiln's cache folder, beside the planner's
//! kept measurements.

use burn::cubecl::config::cache::CacheConfig;
use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// Points CubeCL's kept results at `cubecl/` in kiln's cache folder (`$KILN_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`), unless there is no cache folder, a
/// `cubecl.toml` or `burn.toml` above the working directory names a place of its own, or
/// CubeCL's configuration was already read (its first use fixes it for the process). The
/// configuration otherwise stays as CubeCL reads it (its files, then its `CUBECL_*`
/// variables).
pub(crate) fn keep_tuning() {
    let Some(dir) = crate::plan::cache_folder() else {
        return;
    };
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if matches!(config.environment.path, CacheConfig::Target) {
        config.environment.path = CacheConfig::Directory(dir.join("cubecl"));
        CubeClRuntimeConfig::try_set(config);
    }
}
