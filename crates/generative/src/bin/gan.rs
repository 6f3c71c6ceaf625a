//! `gan`: trains the DCGAN-style GAN with kiln's whole command line.

#[global_allocator]
static ALLOCATOR: kiln::Allocator = kiln::Allocator;

fn main() {
    kiln::App::new("gan", "Train a DCGAN-style GAN with kiln")
        .recipe(include_str!("../../../../configs/gan-digits.toml"))
        .main(kiln_generative::gan::GanWorkload::new)
}
