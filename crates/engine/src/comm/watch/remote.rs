//! The questions one process's watchdog asks the others' (under MPI): where their ranks are.

use std::time::Duration;

/// What the watchdogs of a run's processes say to each other (MPI: a control communicator):
/// on a deadline, the process that waited asks every other where its ranks are; each answers
/// (writing its flight records first), so that the line names the ranks that did not arrive
/// in any process.
pub trait Remote: Send + Sync {
    /// Answers every question that has arrived with `answer(question)`.
    fn serve(&self, answer: &dyn Fn(&str) -> String);
    /// Asks every other process `question` and waits at most `wait` for the answers (serving
    /// questions meanwhile): `(process, answer)` for each that answered.
    fn ask(
        &self,
        question: &str,
        wait: Duration,
        answer: &dyn Fn(&str) -> String,
    ) -> Vec<(usize, String)>;
    /// Called (with the deadline's line) when processes did not answer after a deadline: the
    /// job is cut in parts that cannot reach each other, and this process's part ends its
    /// launcher's daemon as well, which would otherwise wait for the unreachable part.
    fn cut_off(&self, _reason: &str) {}
}

/// How long a process that waited past its deadline waits for the others' answers.
pub(super) const ASK_WAIT: Duration = Duration::from_secs(3);
