//! The bounded FIFO in front of the engine: callers push from any thread, the worker pops. A full
//! queue refuses at once (the server answers 429) instead of letting requests pile up.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use super::job::Job;

/// The job that did not fit; handed back so its sink can be told.
pub struct QueueFull(pub Box<Job>);

impl std::fmt::Debug for QueueFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QueueFull")
    }
}

pub struct Queue {
    capacity: usize,
    state: Mutex<State>,
    ready: Condvar,
}

struct State {
    jobs: VecDeque<(Job, Instant)>,
    closed: bool,
}

impl Queue {
    /// `capacity` counts waiting jobs, not the one running.
    pub fn new(capacity: usize) -> Self {
        Queue {
            capacity,
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock leaves only a VecDeque behind: still consistent.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn push(&self, job: Job) -> Result<(), QueueFull> {
        let mut state = self.lock();
        if state.closed || state.jobs.len() >= self.capacity {
            return Err(QueueFull(Box::new(job)));
        }
        state.jobs.push_back((job, Instant::now()));
        self.ready.notify_one();
        Ok(())
    }

    /// Blocks until a job is waiting (with the time it was queued) or the queue is closed and empty.
    pub fn pop(&self) -> Option<(Job, Instant)> {
        let mut state = self.lock();
        loop {
            if let Some(item) = state.jobs.pop_front() {
                return Some(item);
            }
            if state.closed {
                return None;
            }
            state = self
                .ready
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// The next waiting job, if any, without waiting.
    pub fn try_pop(&self) -> Option<(Job, Instant)> {
        self.lock().jobs.pop_front()
    }

    pub fn len(&self) -> usize {
        self.lock().jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Refuses new jobs from now on and hands back the waiting ones.
    pub fn close(&self) -> Vec<Job> {
        let mut state = self.lock();
        state.closed = true;
        self.ready.notify_all();
        state.jobs.drain(..).map(|(job, _)| job).collect()
    }
}
