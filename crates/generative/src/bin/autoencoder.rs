//! `autoencoder`: trains the autoencoder with kiln's whole command line.

#[global_allocator]
static ALLOCATOR: kiln::Allocator = kiln::Allocator;

fn main() {
    kiln::App::new("autoencoder", "Train an autoencoder with kiln")
        .recipe(include_str!("../../../../configs/autoencoder-digits.toml"))
        .main(kiln_generative::autoencoder::AutoencoderWorkload::new)
}
