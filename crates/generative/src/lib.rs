//! Two generative workloads trained with kiln, written as a crate outside kiln would write
//! them, against kiln's public API only: a DCGAN-style [`gan`] (a discriminator and a
//! generator, each with its own AdamW) and an [`autoencoder`]. Each is a library (model,
//! config sections, [`kiln::Workload`]) and a binary whose `main` is one call to
//! [`kiln::App::main`].
#![deny(missing_docs)]

pub mod autoencoder;
pub mod data;
pub mod gan;
