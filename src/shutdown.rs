//! Cooperative shutdown of the node's background tasks (the jobs, the Redis signal tasks, the
//! feed relay), in the manner of mini-redis: every task holds a [`Shutdown`] and looks at it only
//! between units of work (a job's run, a signal, a relay round), so a ledger call already under
//! way finishes and is waited for; the owner's [`Tasks::stop`] tells them all and waits, with a
//! deadline so that a hung task cannot hold the process, after which it is aborted.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A task's view of the shutdown: [`Shutdown::recv`] completes once it is asked.
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    /// Completes once shutdown is asked (at once if it was already).
    pub async fn recv(&mut self) {
        // An error means the owner is gone: that is a shutdown too.
        let _ = self.0.wait_for(|asked| *asked).await;
    }

    /// Whether shutdown was asked (or its owner is gone, which [`Shutdown::recv`] takes as
    /// asked too).
    pub fn asked(&self) -> bool {
        *self.0.borrow() || self.0.has_changed().is_err()
    }

    /// Runs `work` unless shutdown is asked first: `None` then.
    pub async fn unless<T>(&mut self, work: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            biased;
            _ = self.recv() => None,
            out = work => Some(out),
        }
    }
}

/// A set of tasks that stop together, when asked, and are waited for.
pub struct Tasks {
    ask: watch::Sender<bool>,
    handles: Vec<(&'static str, JoinHandle<()>)>,
}

impl Default for Tasks {
    fn default() -> Self {
        Self::new()
    }
}

impl Tasks {
    pub fn new() -> Self {
        Self {
            ask: watch::channel(false).0,
            handles: Vec::new(),
        }
    }

    /// What a task of this set watches.
    pub fn shutdown(&self) -> Shutdown {
        Shutdown(self.ask.subscribe())
    }

    /// Adds a started task, named for the log.
    pub fn add(&mut self, name: &'static str, handle: JoinHandle<()>) {
        self.handles.push((name, handle));
    }

    /// Asks every task to stop, without waiting.
    pub fn ask(&self) {
        let _ = self.ask.send(true);
    }

    /// Asks every task to stop and waits for each to finish what it was doing, for at most
    /// `deadline` in all; a task still running then is aborted (and logged). Returns how many
    /// were aborted.
    pub async fn stop(self, deadline: Duration) -> usize {
        self.ask();
        let until = tokio::time::Instant::now() + deadline;
        let mut aborted = 0;
        for (name, mut handle) in self.handles {
            if tokio::time::timeout_at(until, &mut handle).await.is_err() {
                tracing::warn!(task = name, "did not stop in time; aborted");
                handle.abort();
                aborted += 1;
            }
        }
        aborted
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;

    /// A task asked to stop in the middle of its work finishes that work, and `stop` returns
    /// only after it did.
    #[tokio::test(start_paused = true)]
    async fn stop_waits_for_the_work_under_way() {
        let mut tasks = Tasks::new();
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let done = Arc::new(AtomicBool::new(false));
        let (mut shutdown, finished) = (tasks.shutdown(), done.clone());
        tasks.add(
            "worker",
            tokio::spawn(async move {
                let _ = started_tx.send(());
                // One unit of work that ignores the shutdown while it runs.
                tokio::time::sleep(Duration::from_secs(2)).await;
                finished.store(true, Ordering::SeqCst);
                shutdown.recv().await;
            }),
        );
        started.await.unwrap();
        tasks.stop(Duration::from_secs(10)).await;
        assert!(
            done.load(Ordering::SeqCst),
            "stop returned before the work ended"
        );
    }

    /// A task that never looks at the shutdown is aborted at the deadline: stop never hangs.
    #[tokio::test(start_paused = true)]
    async fn a_task_that_does_not_stop_is_aborted_at_the_deadline() {
        let mut tasks = Tasks::new();
        let handle = tokio::spawn(std::future::pending::<()>());
        let abort = handle.abort_handle();
        tasks.add("stuck", handle);
        let started = tokio::time::Instant::now();
        assert_eq!(tasks.stop(Duration::from_secs(3)).await, 1);
        assert_eq!(started.elapsed(), Duration::from_secs(3));
        tokio::task::yield_now().await;
        assert!(abort.is_finished(), "the stuck task was not aborted");
    }

    /// `unless` gives up its work once shutdown is asked, and says so.
    #[tokio::test(start_paused = true)]
    async fn unless_gives_way_to_a_shutdown() {
        let tasks = Tasks::new();
        let mut shutdown = tasks.shutdown();
        assert_eq!(shutdown.unless(async { 7 }).await, Some(7));
        let _ = tasks.ask.send(true);
        assert_eq!(shutdown.unless(std::future::pending::<u8>()).await, None);
        assert!(shutdown.asked());
    }

    /// A task whose owner is gone takes that as a shutdown, in `asked` as in `recv`.
    #[tokio::test]
    async fn a_dropped_owner_is_a_shutdown() {
        let tasks = Tasks::new();
        let mut shutdown = tasks.shutdown();
        drop(tasks);
        assert!(shutdown.asked());
        shutdown.recv().await;
    }
}
