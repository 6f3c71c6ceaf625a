//! A module's floats as flat buffers: reading, replacing and laying them out.
//!
//! This is the leaf everyone may import (strategies, the block walk, synchronised BatchNorm,
//! checkpoints): it knows Burn's module traversal and nothing of kiln's other layers.
//!
//! [`FlatLayout`] is the one flat space every strategy's optimizer steps: the trainable
//! parameters grouped into *units* (the parameters outside every block — stem, head, tied
//! weights — then one unit per block of the [`BlockStack`](kiln_models::BlockStack)), each unit
//! padded to a multiple of the shard count and cut into equal pieces. Shard `r` is the
//! concatenation of every unit's piece `r`, so that gathering one unit is one all-gather of
//! equal pieces, and the whole space is the concatenation of the shards' pieces unit by unit.

mod floats;
mod layout;
mod units;

pub use floats::{
    buffers_with_ids, collect_floats, dtype_bytes, float_dtype, float_dtypes, float_tensors,
    frozen_bytes, frozen_with_ids, has_buffers, host_f32, param_tensor, parameter_values,
    replace_floats, running_state_ids, set_frozen, sync_running_state, trainable_ids,
};
pub use layout::{Entry, FlatLayout, Span, Unit, float_shapes, trainable_params};
