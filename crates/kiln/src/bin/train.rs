//! `train`: kiln's command line, a program on [`kiln::App`] around the built-in workloads.

#[global_allocator]
static ALLOCATOR: kiln::Allocator = kiln::Allocator;

fn main() {
    kiln::App::new("train", env!("CARGO_PKG_DESCRIPTION"))
        .version(kiln::VERSION)
        .recipe(kiln::builtin::RECIPE)
        .recipe_origin(kiln::builtin::RECIPE_ORIGIN)
        .command(
            "sample",
            "Generate text with a trained language-model run (any family), or its answer to a prompt",
            kiln::builtin::talk::sample,
        )
        .command(
            "chat",
            "Talk to a fine-tuned run (instruct or chat data): a turn per line of input",
            kiln::builtin::talk::chat,
        )
        .command(
            "answer",
            "Score a run's greedy answers to a file's records (instruct or chat data) by exact match",
            kiln::builtin::answers::answer,
        )
        .main_with(kiln::builtin::check, kiln::builtin::train)
}
