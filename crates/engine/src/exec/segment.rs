//! The backward of one segment of a model, seeded with the gradient from above: the step the
//! block walk, synchronised BatchNorm and a pipeline stage share.

use kiln_models::Activation;

/// Backward of a segment whose forward produced `output`, seeded with `upstream`, the
/// gradient of the objective with respect to `output`.
pub fn segment_backward(output: Activation, upstream: Activation) -> burn::tensor::Gradients {
    output.dot(upstream).backward()
}
