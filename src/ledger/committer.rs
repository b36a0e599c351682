//! The node-wide group committer (DESIGN §2, group commit).
//!
//! Every voucher actor of a node hands its batch here instead of opening a transaction of its
//! own. The committer merges everything pending, from every voucher, into one call of
//! [`super::Ledger::commit_batches`] (one transaction: one fsync on SQLite, one round trip on
//! PostgreSQL) and answers each batch with its own result. Up to `pipeline` merged transactions
//! are in flight at once; while they commit, the queue fills with the next one (double
//! buffering), so under load the ledger is never idle and a batch waits at most one cycle
//! behind other vouchers' work. A lone batch on an idle node is committed at once, as it was
//! before: per-voucher batching is the one-batch case.
//!
//! A voucher appears at most once per transaction: its next batch opens the next one, so the
//! ledger decides each voucher's rows once per transaction and in arrival order.
//!
//! The queue is bounded by construction: an actor has at most `engine.batches_in_flight`
//! batches in flight, so it holds at most that many jobs per live actor. It is still a bounded
//! channel, and a full one answers `QueueFull` (the actor's requests get `503`) rather than
//! growing. A transaction that fails, or takes longer than its deadline, answers each of its
//! batches `CommitFailed` with the reason; nothing of it was acknowledged, and the fence keeps
//! a late commit safe.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::{Batch, BatchResults, LedgerError, RowOutcome};
use crate::metrics as m;

/// What commits a merged transaction: [`super::Ledger::commit_batches`] of the node's ledger.
pub(crate) type CommitFn = Arc<
    dyn Fn(Vec<Batch>) -> Pin<Box<dyn Future<Output = Result<BatchResults, LedgerError>> + Send>>
        + Send
        + Sync,
>;

/// One actor's batch waiting for a merged transaction.
struct Job {
    batch: Batch,
    reply: oneshot::Sender<CommitResult>,
}

/// The handle actors' commits go through. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Committer {
    queue: mpsc::Sender<Job>,
}

/// Jobs the queue holds before new batches are refused.
const QUEUE_CAPACITY: usize = 65_536;

impl Committer {
    /// Spawns the committer loop on `rt`; it ends when every handle is dropped.
    pub(crate) fn start(
        rt: &tokio::runtime::Handle,
        pipeline: usize,
        max_rows: usize,
        deadline: Duration,
        commit: CommitFn,
    ) -> Self {
        let (queue, rx) = mpsc::channel(QUEUE_CAPACITY);
        rt.spawn(run(commit, rx, pipeline.max(1), max_rows.max(1), deadline));
        Self { queue }
    }

    /// Queues `batch` for the next merged transaction; the receiver gets its own result.
    fn submit(&self, batch: Batch) -> Result<oneshot::Receiver<CommitResult>, LedgerError> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .try_send(Job { batch, reply })
            .map_err(|e| match e {
                TrySendError::Full(_) => LedgerError::QueueFull,
                TrySendError::Closed(_) => LedgerError::WorkerGone,
            })?;
        Ok(answer)
    }

    /// Commits `batch` in the next merged transaction and returns its own result.
    pub(crate) async fn commit(&self, batch: Batch) -> CommitResult {
        self.submit(batch)?
            .await
            .unwrap_or_else(|_| Err(LedgerError::WorkerGone))
    }
}

type CommitResult = Result<Vec<RowOutcome>, LedgerError>;

async fn run(
    commit: CommitFn,
    mut rx: mpsc::Receiver<Job>,
    pipeline: usize,
    max_rows: usize,
    deadline: Duration,
) {
    let slots = Arc::new(Semaphore::new(pipeline));
    // Jobs that could not join the transaction being filled: a second batch of a voucher
    // already in it (the ledger decides one voucher once per transaction), or one that would
    // have taken it past `max_rows`. They open the next transaction, in arrival order.
    let mut deferred: VecDeque<Job> = VecDeque::new();
    loop {
        // Wait for a free slot first: while every slot commits, jobs pile up in the queue and
        // all go into the next transaction.
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        if deferred.is_empty() {
            match rx.recv().await {
                Some(job) => deferred.push_back(job),
                None => return,
            }
        }
        let mut jobs: Vec<Job> = Vec::new();
        let mut codes: HashSet<String> = HashSet::new();
        let mut rows = 0;
        let mut later: VecDeque<Job> = VecDeque::new();
        let mut next = deferred.pop_front();
        while let Some(job) = next {
            let n = job.batch.rows.len();
            if codes.contains(&job.batch.voucher_code) || (!jobs.is_empty() && rows + n > max_rows)
            {
                later.push_back(job);
            } else {
                rows += n;
                codes.insert(job.batch.voucher_code.clone());
                jobs.push(job);
            }
            if rows >= max_rows {
                break;
            }
            next = deferred.pop_front().or_else(|| rx.try_recv().ok());
        }
        // Jobs set aside arrived before the ones not looked at yet: they go first.
        later.extend(deferred.drain(..));
        deferred = later;
        let (batches, replies): (Vec<Batch>, Vec<_>) =
            jobs.into_iter().map(|j| (j.batch, j.reply)).unzip();
        let n = batches.len();
        let transaction = commit(batches);
        m::merged_commit_started();
        tokio::spawn(async move {
            let started = Instant::now();
            let result = match tokio::time::timeout(deadline, transaction).await {
                Ok(result) => result,
                Err(_) => Err(LedgerError::Deadline),
            };
            m::merged_commit(n, rows, started.elapsed(), result.is_ok());
            drop(permit);
            let failed = match result {
                Ok(results) if results.len() == n => {
                    for (reply, res) in replies.into_iter().zip(results) {
                        let _ = reply.send(res);
                    }
                    return;
                }
                Ok(_) => {
                    tracing::error!("merged commit answered the wrong number of batches");
                    LedgerError::database("merged commit answered the wrong number of batches")
                }
                Err(e) => {
                    tracing::warn!(error = %e, batches = n, "merged commit failed");
                    e
                }
            };
            let failed = Arc::new(failed);
            for reply in replies {
                let _ = reply.send(Err(LedgerError::CommitFailed(failed.clone())));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::BatchRow;
    use std::sync::Mutex;

    /// A deadline no test reaches unless it means to.
    const LONG: Duration = Duration::from_secs(3600);

    fn batch(code: &str, rows: usize) -> Batch {
        Batch {
            voucher_code: code.into(),
            lease_id: 1,
            now: 0,
            expires_at: 1,
            rows: (0..rows)
                .map(|i| BatchRow {
                    order_id: format!("{code}-{i}"),
                    customer_id: 1 + i as i64,
                })
                .collect(),
        }
    }

    /// A commit function that records the vouchers of every merged call and holds the first
    /// call open until `release` fires, so that the test controls what queues behind it.
    /// The vouchers of every merged call, in call order.
    type Calls = Arc<Mutex<Vec<Vec<String>>>>;

    fn recording(release: oneshot::Receiver<()>) -> (CommitFn, Calls, mpsc::UnboundedReceiver<()>) {
        let calls = Arc::new(Mutex::new(Vec::<Vec<String>>::new()));
        let gate = Arc::new(Mutex::new(Some(release)));
        let (started_tx, started) = mpsc::unbounded_channel();
        let seen = calls.clone();
        let commit: CommitFn = Arc::new(move |batches: Vec<Batch>| {
            let codes: Vec<String> = batches.iter().map(|b| b.voucher_code.clone()).collect();
            seen.lock().unwrap().push(codes);
            let gate = gate.lock().unwrap().take();
            let started_tx = started_tx.clone();
            Box::pin(async move {
                let _ = started_tx.send(());
                if let Some(gate) = gate {
                    let _ = gate.await;
                }
                Ok(batches
                    .iter()
                    .map(|b| match b.voucher_code.as_str() {
                        "FENCED" => Err(LedgerError::Fenced),
                        _ => Ok(vec![RowOutcome::AlreadyUsed; b.rows.len()]),
                    })
                    .collect())
            })
        });
        (commit, calls, started)
    }

    /// Commits `first` alone, queues `rest` while that transaction holds the only slot, then
    /// lets it finish. Returns each queued batch's answer and the vouchers of every call.
    async fn queue_behind_a_commit(
        max_rows: usize,
        first: Batch,
        rest: &[(&str, usize)],
    ) -> (Vec<CommitResult>, Vec<Vec<String>>) {
        let (release, gate) = oneshot::channel();
        let (commit, calls, mut started) = recording(gate);
        let c = Committer::start(
            &tokio::runtime::Handle::current(),
            1,
            max_rows,
            LONG,
            commit,
        );
        let first_rows = first.rows.len();
        let first = c.submit(first).unwrap();
        started.recv().await.unwrap();
        let queued: Vec<_> = rest
            .iter()
            .map(|(code, rows)| c.submit(batch(code, *rows)).unwrap())
            .collect();
        release.send(()).unwrap();
        assert_eq!(first.await.unwrap().unwrap().len(), first_rows);
        let answers = futures_util::future::join_all(queued)
            .await
            .into_iter()
            .map(|a| a.expect("answered"))
            .collect();
        let calls = calls.lock().unwrap().clone();
        (answers, calls)
    }

    fn codes(calls: &[&[&str]]) -> Vec<Vec<String>> {
        calls
            .iter()
            .map(|c| c.iter().map(|s| s.to_string()).collect())
            .collect()
    }

    #[tokio::test]
    async fn batches_queued_behind_a_commit_share_the_next_transaction() {
        let (answers, calls) = queue_behind_a_commit(
            10_000,
            batch("A", 3),
            &[("B", 2), ("C", 2), ("FENCED", 2), ("D", 2)],
        )
        .await;
        assert_eq!(answers[0].as_ref().unwrap().len(), 2);
        assert!(
            matches!(answers[2], Err(LedgerError::Fenced)),
            "each batch gets its own result"
        );
        assert!(answers[3].is_ok());
        assert_eq!(
            calls,
            codes(&[&["A"], &["B", "C", "FENCED", "D"]]),
            "one transaction for the first batch, one for everything that queued behind it"
        );
    }

    #[tokio::test]
    async fn a_transaction_stops_at_max_rows_and_the_rest_opens_the_next() {
        let (answers, calls) =
            queue_behind_a_commit(4, batch("A", 1), &[("B", 2), ("C", 2), ("D", 2)]).await;
        assert!(answers.iter().all(Result::is_ok));
        assert_eq!(calls, codes(&[&["A"], &["B", "C"], &["D"]]));
    }

    #[tokio::test]
    async fn a_batch_that_would_pass_max_rows_waits_for_the_next_transaction() {
        let (answers, calls) = queue_behind_a_commit(4, batch("A", 1), &[("B", 3), ("C", 2)]).await;
        assert!(answers.iter().all(Result::is_ok));
        assert_eq!(calls, codes(&[&["A"], &["B"], &["C"]]));
    }

    #[tokio::test]
    async fn a_batch_larger_than_max_rows_commits_alone() {
        let (answers, calls) = queue_behind_a_commit(4, batch("A", 1), &[("E", 6)]).await;
        assert!(answers.iter().all(Result::is_ok));
        assert_eq!(calls, codes(&[&["A"], &["E"]]));
    }

    #[tokio::test]
    async fn a_voucher_appears_once_per_transaction_and_keeps_its_order() {
        let (answers, calls) = queue_behind_a_commit(
            10_000,
            batch("A", 1),
            &[("B", 1), ("C", 1), ("B", 1), ("A", 1), ("B", 1)],
        )
        .await;
        assert!(answers.iter().all(Result::is_ok));
        assert_eq!(calls, codes(&[&["A"], &["B", "C", "A"], &["B"], &["B"]]));
    }

    #[tokio::test]
    async fn a_transaction_past_its_deadline_answers_unavailable_and_frees_its_slot() {
        let calls = Arc::new(Mutex::new(0));
        let seen = calls.clone();
        let commit: CommitFn = Arc::new(move |batches: Vec<Batch>| {
            let first = {
                let mut n = seen.lock().unwrap();
                *n += 1;
                *n == 1
            };
            Box::pin(async move {
                if first {
                    // The first transaction hangs (a stuck connection).
                    std::future::pending::<()>().await;
                }
                Ok(batches
                    .iter()
                    .map(|b| Ok(vec![RowOutcome::AlreadyUsed; b.rows.len()]))
                    .collect())
            })
        });
        let c = Committer::start(
            &tokio::runtime::Handle::current(),
            1,
            100,
            Duration::from_millis(50),
            commit,
        );
        let hung = c.commit(batch("A", 1)).await;
        let Err(LedgerError::CommitFailed(cause)) = &hung else {
            panic!("{hung:?}");
        };
        assert!(matches!(**cause, LedgerError::Deadline), "{hung:?}");
        let next = c.commit(batch("B", 1)).await;
        assert!(next.is_ok(), "the slot came back: {next:?}");
        assert_eq!(*calls.lock().unwrap(), 2);
    }

    #[tokio::test]
    async fn a_failed_transaction_answers_every_batch_in_it_unavailable() {
        let commit: CommitFn =
            Arc::new(|_| Box::pin(async { Err(LedgerError::Invalid("the database went away")) }));
        let c = Committer::start(&tokio::runtime::Handle::current(), 2, 100, LONG, commit);
        let res = c.commit(batch("A", 2)).await;
        let Err(LedgerError::CommitFailed(cause)) = &res else {
            panic!("{res:?}");
        };
        assert!(matches!(**cause, LedgerError::Invalid(_)), "{res:?}");
    }

    /// A committer whose loop is gone (its runtime stopped) refuses a batch at once, as the
    /// ledger worker it is, rather than queue it for nobody.
    #[test]
    fn a_stopped_committer_answers_worker_gone() {
        let stopped = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (commit, _calls, _started) = recording(oneshot::channel().1);
        let c = Committer::start(stopped.handle(), 1, 100, LONG, commit);
        // The loop was spawned but never ran: it goes, with its queue, as the runtime does.
        drop(stopped);
        let caller = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let res = caller.block_on(c.commit(batch("A", 1)));
        assert!(matches!(res, Err(LedgerError::WorkerGone)), "{res:?}");
    }

    /// A ledger whose answer does not match the transaction's batches one for one is not
    /// trusted with any of them: nothing is answered as committed.
    #[tokio::test]
    async fn an_answer_with_the_wrong_number_of_results_answers_every_batch_unavailable() {
        let commit: CommitFn = Arc::new(|batches: Vec<Batch>| {
            Box::pin(async move {
                let mut results: Vec<CommitResult> = vec![Ok(Vec::new())];
                results.extend(
                    batches
                        .iter()
                        .map(|b| Ok(vec![RowOutcome::AlreadyUsed; b.rows.len()])),
                );
                Ok(results)
            })
        });
        let c = Committer::start(&tokio::runtime::Handle::current(), 1, 100, LONG, commit);
        let res = c.commit(batch("A", 2)).await;
        assert!(matches!(res, Err(LedgerError::CommitFailed(_))), "{res:?}");
    }
}
