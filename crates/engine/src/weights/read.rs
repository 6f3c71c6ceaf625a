//! The tensors of a weights file as they are stored, for inspection and comparisons.

use std::collections::BTreeMap;
use std::path::Path;

use burn::store::{BurnpackStore, ModuleStore, SafetensorsStore};

use crate::config::one_line;
use crate::error::{Error, Result};

/// One stored tensor: its shape and its values widened to f32.
pub type Stored = (Vec<usize>, Vec<f32>);

/// Every float tensor of a `.safetensors` or `.bpk` file by name, its values in f32.
pub fn read_tensors(path: &Path) -> Result<BTreeMap<String, Stored>> {
    let fail = |e: &dyn std::fmt::Display| {
        Error::checkpoint(format!("{}: {}", path.display(), one_line(e)))
    };
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let mut out = BTreeMap::new();
    let mut take = |name: &String, t: &burn::store::burn_pack::Tensor| -> Result<()> {
        let data = burn::store::bridge::to_data(t).map_err(|e| fail(&e))?;
        if !data.dtype().is_float() {
            return Ok(());
        }
        let shape = data.shape().to_vec();
        let values = data
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| fail(&format!("{e:?}")))?;
        out.insert(name.clone(), (shape, values));
        Ok(())
    };
    match ext {
        "safetensors" => {
            let mut store = SafetensorsStore::from_file(path);
            for (name, t) in store.get_all_tensors().map_err(|e| fail(&e))? {
                take(name, t)?;
            }
        }
        "bpk" => {
            let mut store = BurnpackStore::from_file(path);
            for (name, t) in store.get_all_tensors().map_err(|e| fail(&e))? {
                take(name, t)?;
            }
        }
        _ => {
            return Err(Error::checkpoint(format!(
                "{}: expected a .safetensors or .bpk file",
                path.display()
            )));
        }
    }
    Ok(out)
}
