//! Calls of many callers merged into one ledger round trip, the way the committer merges
//! batches: the node's voucher reads and lease grants. When the first voucher of a campaign's
//! thousands is asked for at the same second as the others, each of their actors reads its
//! definition and takes its first lease; one at a time per call, that is two round trips (one a
//! write with its own `fsync` on SQLite) per voucher. Here every call waiting when the previous
//! merged call ends goes into the next one: one round trip for all of them.
//!
//! One merged call is in flight at a time, so a lone call on an idle node goes at once and
//! under load the queue fills while the previous call runs. The queue is bounded: full, a call
//! fails at once with `QueueFull` (`503`), never waits in an unbounded line; a call that waited
//! in it past the deadline fails with `Deadline` without going to the ledger (its caller has
//! given up). A merged call runs as a task of its own: one that panics fails its calls, not the
//! loop.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::LedgerError;

/// The merged call: every query in, one answer per query out, in order (or one error for all).
pub(crate) type ManyFn<Q, A> = Arc<
    dyn Fn(
            Vec<Q>,
        )
            -> Pin<Box<dyn Future<Output = Result<Vec<Result<A, LedgerError>>, LedgerError>> + Send>>
        + Send
        + Sync,
>;

type Reply<A> = oneshot::Sender<Result<A, LedgerError>>;

/// A query, where its answer goes, and when it was queued.
type Queued<Q, A> = (Q, Reply<A>, Instant);

/// The handle callers go through. Cheap to clone.
pub(crate) struct Coalescer<Q, A> {
    queue: mpsc::Sender<Queued<Q, A>>,
}

impl<Q, A> Clone for Coalescer<Q, A> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
        }
    }
}

/// Calls the queue holds before new ones are refused.
const QUEUE_CAPACITY: usize = 65_536;

impl<Q: Send + 'static, A: Send + 'static> Coalescer<Q, A> {
    /// Spawns the loop on `rt`, merging at most `max` calls into one; it ends when every handle
    /// is dropped. A merged call not answered within `deadline` fails every call in it.
    pub(crate) fn start(
        rt: &tokio::runtime::Handle,
        max: usize,
        deadline: Duration,
        many: ManyFn<Q, A>,
    ) -> Self {
        let (queue, rx) = mpsc::channel(QUEUE_CAPACITY);
        rt.spawn(run(many, rx, max.max(1), deadline));
        Self { queue }
    }

    /// Runs `query` in the next merged call and returns its own answer.
    pub(crate) async fn call(&self, query: Q) -> Result<A, LedgerError> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .try_send((query, reply, Instant::now()))
            .map_err(|e| match e {
                TrySendError::Full(_) => LedgerError::QueueFull,
                TrySendError::Closed(_) => LedgerError::WorkerGone,
            })?;
        answer.await.unwrap_or(Err(LedgerError::WorkerGone))
    }
}

async fn run<Q: Send + 'static, A: Send + 'static>(
    many: ManyFn<Q, A>,
    mut rx: mpsc::Receiver<Queued<Q, A>>,
    max: usize,
    deadline: Duration,
) {
    while let Some(first) = rx.recv().await {
        let mut calls = vec![first];
        while calls.len() < max {
            match rx.try_recv() {
                Ok(call) => calls.push(call),
                Err(_) => break,
            }
        }
        let now = Instant::now();
        let (queries, replies): (Vec<Q>, Vec<Reply<A>>) = calls
            .into_iter()
            .filter_map(|(query, reply, queued)| {
                if now.duration_since(queued) < deadline {
                    return Some((query, reply));
                }
                let _ = reply.send(Err(LedgerError::Deadline));
                None
            })
            .unzip();
        let n = queries.len();
        if n == 0 {
            continue;
        }
        let mut call = tokio::spawn(many(queries));
        let answers = match tokio::time::timeout(deadline, &mut call).await {
            Ok(Ok(Ok(answers))) if answers.len() == n => answers,
            Ok(Ok(Ok(_))) => {
                let e = LedgerError::Inconsistent("a merged call answered the wrong number");
                tracing::error!(error = %e, calls = n);
                fail_all(replies, Arc::new(e));
                continue;
            }
            Ok(Ok(Err(e))) => {
                fail_all(replies, Arc::new(e));
                continue;
            }
            Ok(Err(panicked)) => {
                tracing::error!(error = %panicked, calls = n, "a merged ledger call panicked");
                fail_all(replies, Arc::new(LedgerError::WorkerGone));
                continue;
            }
            Err(_) => {
                call.abort();
                fail_all(replies, Arc::new(LedgerError::Deadline));
                continue;
            }
        };
        for (reply, answer) in replies.into_iter().zip(answers) {
            let _ = reply.send(answer);
        }
    }
}

/// Every call of a merged call that failed as a whole gets the cause.
fn fail_all<A>(replies: Vec<Reply<A>>, cause: Arc<LedgerError>) {
    for reply in replies {
        let _ = reply.send(Err(LedgerError::CommitFailed(cause.clone())));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Calls that wait while a merged call runs go together into the next one, each gets its
    /// own answer, and a merged call that fails fails each of its calls.
    #[tokio::test]
    async fn waiting_calls_share_the_next_round_trip() {
        let rounds = Arc::new(AtomicUsize::new(0));
        let r = rounds.clone();
        let many: ManyFn<i64, i64> = Arc::new(move |qs| {
            let r = r.clone();
            Box::pin(async move {
                r.fetch_add(1, Ordering::SeqCst);
                tokio::task::yield_now().await;
                if qs.contains(&-1) {
                    return Err(LedgerError::Deadline);
                }
                Ok(qs
                    .into_iter()
                    .map(|q| {
                        if q == 0 {
                            Err(LedgerError::NotFound)
                        } else {
                            Ok(q * 10)
                        }
                    })
                    .collect())
            })
        });
        let c = Coalescer::start(
            &tokio::runtime::Handle::current(),
            100,
            Duration::from_secs(5),
            many,
        );
        let answers = futures_util::future::join_all((0..50).map(|q| c.call(q))).await;
        assert!(matches!(answers[0], Err(LedgerError::NotFound)));
        for (q, a) in answers.iter().enumerate().skip(1) {
            assert_eq!(*a.as_ref().unwrap(), q as i64 * 10);
        }
        assert!(
            rounds.load(Ordering::SeqCst) <= 2,
            "50 calls at once took {} round trips",
            rounds.load(Ordering::SeqCst)
        );
        assert!(matches!(
            c.call(-1).await,
            Err(LedgerError::CommitFailed(_))
        ));
    }

    /// A merged call that panics fails its own calls and the loop goes on; a call that waited
    /// in the queue past the deadline fails without reaching the ledger.
    #[tokio::test(start_paused = true)]
    async fn a_panic_fails_its_calls_only_and_stale_calls_never_run() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s = seen.clone();
        let many: ManyFn<i64, i64> = Arc::new(move |qs| {
            s.lock().unwrap().extend(qs.iter().copied());
            Box::pin(async move {
                if qs.contains(&-1) {
                    panic!("a bug in a merged call");
                }
                if qs.contains(&-2) {
                    // Holds the loop while later calls wait in the queue.
                    tokio::time::sleep(Duration::from_secs(3)).await;
                }
                Ok(qs.into_iter().map(Ok).collect())
            })
        });
        let c = Coalescer::start(
            &tokio::runtime::Handle::current(),
            100,
            Duration::from_secs(2),
            many,
        );
        assert!(matches!(
            c.call(-1).await,
            Err(LedgerError::CommitFailed(e)) if matches!(*e, LedgerError::WorkerGone)
        ));
        assert_eq!(c.call(7).await.unwrap(), 7, "the loop outlived the panic");
        // -2 holds the ledger past the deadline; 8, queued behind it, has waited too long by
        // the time the loop takes it.
        let slow = tokio::spawn({
            let c = c.clone();
            async move { c.call(-2).await }
        });
        while !seen.lock().unwrap().contains(&-2) {
            tokio::task::yield_now().await;
        }
        let stale = c.call(8).await;
        assert!(matches!(stale, Err(LedgerError::Deadline)), "{stale:?}");
        assert!(matches!(
            slow.await.unwrap(),
            Err(LedgerError::CommitFailed(_))
        ));
        assert!(
            !seen.lock().unwrap().contains(&8),
            "a stale call reached the ledger"
        );
    }
}
