//! The control channel: the processes' watchdogs ask each other where their ranks are, on a
//! duplicate of the world communicator, and a process cut off from the others ends its job.

use std::sync::Arc;

use mpi::traits::*;

use super::runtime::{Comm, STATE, say_once};
use crate::comm::watch::Remote;

/// Tags of the control communicator's messages.
const ASK: i32 = 1;

const TELL: i32 = 2;

/// The processes' watchdogs talking on their own communicator (a duplicate of the world), from
/// one thread per process: questions and answers are short texts, sent without waiting for the
/// receiver (a process cut off from the others must not block its watchdog).
struct Control {
    comm: Arc<Comm>,
    me: usize,
    processes: usize,
}

/// The control channel, once MPI runs.
pub fn control() -> Option<Box<dyn Remote>> {
    let state = STATE.get()?;
    Some(Box::new(Control {
        comm: state.control.clone(),
        me: state.processes.index,
        processes: state.processes.count,
    }))
}

impl Control {
    /// Sends `text` to process `to` and returns at once (the buffer lives until the send is
    /// done, which may be never when `to` is cut off: the few bytes are left behind).
    fn post(&self, to: usize, tag: i32, text: String) {
        let bytes: &'static [u8] = Box::leak(text.into_bytes().into_boxed_slice());
        // SAFETY: the buffer is 'static, so it outlives the send; freeing the request is
        // allowed while the send is in progress (MPI completes it in the background).
        unsafe {
            let mut request = std::mem::MaybeUninit::uninit();
            mpi::ffi::MPI_Isend(
                bytes.as_ptr().cast(),
                bytes.len() as i32,
                u8::equivalent_datatype().as_raw(),
                to as i32,
                tag,
                self.comm.0.as_raw(),
                request.as_mut_ptr(),
            );
            let mut request = request.assume_init();
            mpi::ffi::MPI_Request_free(&mut request);
        }
    }

    /// The next message with `tag` that has arrived, and its sender.
    fn take(&self, tag: i32) -> Option<(usize, String)> {
        let probed = self
            .comm
            .0
            .any_process()
            .immediate_matched_probe_with_tag(tag)?;
        let (bytes, status) = probed.matched_receive_vec::<u8>();
        Some((
            status.source_rank() as usize,
            String::from_utf8_lossy(&bytes).into_owned(),
        ))
    }
}

impl Remote for Control {
    fn serve(&self, answer: &dyn Fn(&str) -> String) {
        while let Some((from, question)) = self.take(ASK) {
            self.post(from, TELL, answer(&question));
        }
    }

    fn ask(
        &self,
        question: &str,
        wait: std::time::Duration,
        answer: &dyn Fn(&str) -> String,
    ) -> Vec<(usize, String)> {
        let others: Vec<usize> = (0..self.processes).filter(|p| *p != self.me).collect();
        for &p in &others {
            self.post(p, ASK, question.to_string());
        }
        let started = std::time::Instant::now();
        let mut answers = Vec::new();
        while answers.len() < others.len() && started.elapsed() < wait {
            self.serve(answer);
            match self.take(TELL) {
                Some(a) => answers.push(a),
                None => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
        answers
    }

    fn cut_off(&self, reason: &str) {
        // OpenMPI's daemons (mpirun on its machine, orted on the others) wait for the
        // processes of the other part until TCP gives up on the link, ~15 min. A daemon that
        // gets SIGTERM ends its processes and leaves; mpirun already taking the job down
        // leaves at once on the second.
        let parent = unsafe { libc::getppid() };
        let name = std::fs::read_to_string(format!("/proc/{parent}/comm")).unwrap_or_default();
        if !LAUNCHER_DAEMONS.contains(&name.trim()) {
            return;
        }
        say_once(&format!(
            "{reason}; cut off from them, this process ends its launcher ({} {parent})",
            name.trim()
        ));
        for _ in 0..2 {
            // SAFETY: a signal to the process that started this one.
            unsafe { libc::kill(parent, libc::SIGTERM) };
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    }
}

/// The launcher daemons `Control::cut_off` ends (OpenMPI's and PRRTE's).
const LAUNCHER_DAEMONS: [&str; 6] = ["mpirun", "mpiexec", "orterun", "orted", "prterun", "prted"];
