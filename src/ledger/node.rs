//! The node's ledger: what every caller on the node (actors, routes, jobs) holds as its
//! [`SharedLedger`], wrapped around the store ([`super::sqlite`], [`super::postgres`]).
//!
//! [`NodeLedger`] owns what the node adds to each call:
//! - the hop onto the ledger's own runtime. Database sockets belong to the reactor of the
//!   runtime that opened them: a pool connection opened by a busy HTTP worker would only be
//!   polled when that worker gets round to its reactor, adding the worker's loop time to every
//!   round trip of every batch. Here all connections live on a small runtime that does nothing
//!   else (`ledger.runtime_threads`, one by default), and callers on any runtime await a task
//!   spawned there;
//! - the deadline: no call waits longer than `ledger.timeout_ms` ([`LedgerError::Deadline`]);
//!   a heartbeat a third of its liveness limit;
//! - the node's circuit [`Breaker`], which every call but the heartbeat passes;
//! - the node-wide group [`Committer`], which `commit_batch` goes through, so the batches of
//!   every voucher of the node share transactions;
//! - the [`Coalescer`]s that merge the actors' voucher reads, lease grants and lease returns,
//!   and the admin API's creates, into one round trip each (the first reserves on thousands of
//!   cold vouchers at once, their returns when they idle, a campaign's vouchers created at once).

use std::future::Future;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::runtime::Handle;

use super::breaker::Breaker;
use super::coalesce::Coalescer;
use super::committer::Committer;
use super::{
    Batch, BatchResults, Beat, Counters, Grant, GrantAsk, Incarnation, Ledger, LedgerError,
    LiveUnits, OpenAsk, Opened, Restock, RowOutcome, SharedLedger,
};
use crate::clock::Millis;
use crate::config::LedgerSettings;
use crate::domain::{FeedEvent, Reservation, Switches, SwitchesPatch, Voucher, VoucherPatch};

/// The store a node talks to, behind the node's runtime, deadline, breaker and group committer
/// (see the module doc).
pub struct NodeLedger {
    inner: SharedLedger,
    rt: Handle,
    /// Where the actors' batches go: merged with every other voucher's into shared transactions.
    committer: Committer,
    /// No call waits longer than this: a hung connection answers `Deadline`, not never.
    deadline: std::time::Duration,
    /// Every call passes it: while it is open, calls fail at once without touching the ledger.
    /// The committer records each merged transaction on it once.
    breaker: Arc<Breaker>,
    /// The actors' voucher reads, merged.
    reads: Coalescer<String, Option<Voucher>>,
    /// The actors' lease grants, merged into one transaction.
    grants: Coalescer<GrantAsk, Grant>,
    /// The cold actors' first calls (a read and a first grant), merged: one read and one grant
    /// transaction for all of them.
    opens: Coalescer<OpenAsk, Opened>,
    /// The actors' lease returns, merged into one transaction.
    returns: Coalescer<(i64, Millis), Option<Restock>>,
    /// Creates of vouchers (the admin API's), merged into one transaction.
    creates: Coalescer<(Voucher, Millis), ()>,
}

/// Most calls merged into one voucher read or one grant transaction.
const MAX_MERGED_CALLS: usize = 1024;

impl NodeLedger {
    /// Wraps `inner` so that every call runs on `rt`, and starts the node's group committer
    /// there.
    pub fn start(inner: SharedLedger, rt: Handle, settings: &LedgerSettings) -> Self {
        Self::start_shard(inner, rt, settings, None)
    }

    /// [`NodeLedger::start`] for shard `shard` of a sharded ledger (its breaker's metrics carry
    /// the shard).
    pub fn start_shard(
        inner: SharedLedger,
        rt: Handle,
        settings: &LedgerSettings,
        shard: Option<usize>,
    ) -> Self {
        let deadline = std::time::Duration::from_millis(settings.timeout_ms.max(1));
        // The merged calls' own deadline runs inside the breaker (a hung ledger counts as a
        // failure there); the coalescers' is a backstop behind it.
        let backstop = deadline + std::time::Duration::from_secs(1);
        let mut breaker = Breaker::new(settings.breaker_failures, settings.breaker_open_ms)
            .of_store(inner.clone());
        if let Some(s) = shard {
            breaker = breaker.for_shard(s);
        }
        let breaker = Arc::new(breaker);
        let (merged, guard) = (inner.clone(), breaker.clone());
        let committer = Committer::start(
            &rt,
            settings.pipeline(),
            settings.max_merged_rows.max(1),
            deadline,
            Arc::new(move |batches| {
                let (ledger, guard) = (merged.clone(), guard.clone());
                // A merged transaction passes the breaker once, however many batches it carries;
                // its deadline runs inside, so a hung one counts as a failure there.
                Box::pin(async move {
                    guard
                        .call(within(deadline, ledger.commit_batches(&batches)))
                        .await
                })
            }),
        );
        let (ledger, guard) = (inner.clone(), breaker.clone());
        let reads = Coalescer::start(
            &rt,
            MAX_MERGED_CALLS,
            backstop,
            Arc::new(move |codes: Vec<String>| {
                let (ledger, guard) = (ledger.clone(), guard.clone());
                Box::pin(async move {
                    let found = read_merged(&ledger, &guard, deadline, &codes).await?;
                    Ok(found.into_iter().map(Ok).collect())
                })
            }),
        );
        let (ledger, guard) = (inner.clone(), breaker.clone());
        let grants = Coalescer::start(
            &rt,
            MAX_MERGED_CALLS,
            backstop,
            Arc::new(move |asks: Vec<GrantAsk>| {
                let (ledger, guard) = (ledger.clone(), guard.clone());
                Box::pin(async move { grant_merged(&ledger, &guard, deadline, &asks).await })
            }),
        );
        let (ledger, guard) = (inner.clone(), breaker.clone());
        let opens = Coalescer::start(
            &rt,
            MAX_MERGED_CALLS,
            // Two calls in a row (a read, then a grant), each with its own deadline.
            backstop + deadline,
            Arc::new(move |asks: Vec<OpenAsk>| {
                let (ledger, guard) = (ledger.clone(), guard.clone());
                Box::pin(async move { open_merged(&ledger, &guard, deadline, asks).await })
            }),
        );
        let (ledger, guard) = (inner.clone(), breaker.clone());
        let returns = Coalescer::start(
            &rt,
            MAX_MERGED_CALLS,
            backstop,
            Arc::new(move |leases: Vec<(i64, Millis)>| {
                let (ledger, guard) = (ledger.clone(), guard.clone());
                Box::pin(async move {
                    let answers = guard
                        .call(within(deadline, ledger.return_leases(&leases)))
                        .await?;
                    Ok(answers.into_iter().map(Ok).collect())
                })
            }),
        );
        let (ledger, guard) = (inner.clone(), breaker.clone());
        let creates = Coalescer::start(
            &rt,
            MAX_MERGED_CALLS,
            backstop,
            Arc::new(move |vouchers: Vec<(Voucher, Millis)>| {
                let (ledger, guard) = (ledger.clone(), guard.clone());
                Box::pin(async move {
                    guard
                        .call(within(deadline, ledger.create_vouchers(&vouchers)))
                        .await
                })
            }),
        );
        Self {
            inner,
            rt,
            committer,
            deadline,
            breaker,
            reads,
            grants,
            opens,
            returns,
            creates,
        }
    }

    async fn run<T, F, Fut>(&self, f: F) -> Result<T, LedgerError>
    where
        T: Send + 'static,
        F: FnOnce(SharedLedger) -> Fut,
        Fut: Future<Output = Result<T, LedgerError>> + Send + 'static,
    {
        let fut = f(self.inner.clone());
        self.breaker
            .call(self.on_ledger_runtime(self.deadline, fut))
            .await
    }

    /// Runs `fut` on the ledger's runtime and gives up after `deadline`.
    async fn on_ledger_runtime<T, Fut>(
        &self,
        deadline: std::time::Duration,
        fut: Fut,
    ) -> Result<T, LedgerError>
    where
        T: Send + 'static,
        Fut: Future<Output = Result<T, LedgerError>> + Send + 'static,
    {
        match tokio::time::timeout(deadline, self.rt.spawn(fut)).await {
            Ok(Ok(res)) => res,
            Ok(Err(_)) => Err(LedgerError::WorkerGone),
            Err(_) => Err(LedgerError::Deadline),
        }
    }
}

/// One merged read of `codes` through the breaker: each code's definition, in order (a code
/// asked twice, by an actor and its successor, gets its answer twice).
async fn read_merged(
    ledger: &SharedLedger,
    guard: &Breaker,
    deadline: std::time::Duration,
    codes: &[String],
) -> Result<Vec<Option<Voucher>>, LedgerError> {
    let found = guard.call(within(deadline, ledger.vouchers(codes))).await?;
    // By code, not a scan of the answer per code: a merged read of a thousand codes would
    // compare a million strings on the ledger's thread.
    let found: std::collections::HashMap<&str, &Voucher> =
        found.iter().map(|v| (v.code.as_str(), v)).collect();
    Ok(codes
        .iter()
        .map(|c| found.get(c.as_str()).map(|v| (*v).clone()))
        .collect())
}

/// One merged grant transaction through the breaker, each ask with its own answer.
async fn grant_merged(
    ledger: &SharedLedger,
    guard: &Breaker,
    deadline: std::time::Duration,
    asks: &[GrantAsk],
) -> Result<Vec<Result<Grant, LedgerError>>, LedgerError> {
    match guard.call(within(deadline, ledger.grant_many(asks))).await {
        // The ledger refused the merged grant (a lock wait that timed out on one busy voucher,
        // a check): that must not fail every voucher in it, so each goes again on its own.
        Err(LedgerError::Database { .. }) if asks.len() > 1 => {
            let mut answers = Vec::with_capacity(asks.len());
            for ask in asks {
                let one = std::slice::from_ref(ask);
                answers.push(
                    match guard.call(within(deadline, ledger.grant_many(one))).await {
                        Ok(mut got) => got
                            .pop()
                            .unwrap_or(Err(LedgerError::Inconsistent("a grant left unanswered"))),
                        Err(e) => Err(e),
                    },
                );
            }
            Ok(answers)
        }
        other => other,
    }
}

/// Merged opens ([`Ledger::open`]): one read of every voucher asked, then one grant transaction
/// for those that serve their first order now. A failed read fails them all with no grant
/// asked; a failed grant transaction is each one's grant answer.
async fn open_merged(
    ledger: &SharedLedger,
    guard: &Breaker,
    deadline: std::time::Duration,
    asks: Vec<OpenAsk>,
) -> Result<Vec<Result<Opened, LedgerError>>, LedgerError> {
    let codes: Vec<String> = asks.iter().map(|a| a.grant.code.clone()).collect();
    let read = read_merged(ledger, guard, deadline, &codes).await?;
    let serving: Vec<usize> = (0..asks.len())
        .filter(|&i| read[i].as_ref().is_some_and(|v| asks[i].serves(v)))
        .collect();
    let mut grants: Vec<Option<Result<Grant, LedgerError>>> = asks.iter().map(|_| None).collect();
    if !serving.is_empty() {
        let grant_asks: Vec<GrantAsk> = serving.iter().map(|&i| asks[i].grant.clone()).collect();
        match grant_merged(ledger, guard, deadline, &grant_asks).await {
            Ok(answers) if answers.len() == serving.len() => {
                for (&i, a) in serving.iter().zip(answers) {
                    grants[i] = Some(a);
                }
            }
            Ok(_) => {
                for &i in &serving {
                    grants[i] = Some(Err(LedgerError::Inconsistent(
                        "a merged grant answered the wrong number",
                    )));
                }
            }
            Err(e) => {
                let e = Arc::new(e);
                for &i in &serving {
                    grants[i] = Some(Err(LedgerError::CommitFailed(e.clone())));
                }
            }
        }
    }
    Ok(read
        .into_iter()
        .zip(grants)
        .map(|(voucher, grant)| Ok(Opened { voucher, grant }))
        .collect())
}

#[async_trait]
impl Ledger for NodeLedger {
    fn breaker(&self) -> Option<&Breaker> {
        Some(self.breaker.as_ref())
    }

    fn lost(&self) {
        self.inner.lost();
    }

    fn server(&self) -> Option<(String, u64)> {
        self.inner.server()
    }

    fn failovers(&self) -> u64 {
        self.inner.failovers()
    }

    async fn ping(&self) -> Result<(), LedgerError> {
        self.run(|l| async move { l.ping().await }).await
    }

    /// On the ledger's runtime (each of whose threads then hands back its own pages too, once
    /// idle; the caller trims glibc's arenas), outside the breaker: housekeeping, not a call
    /// that says whether the ledger is up.
    async fn give_back_memory(&self) {
        let inner = self.inner.clone();
        let fut = async move {
            inner.give_back_memory().await;
            crate::memory::ask_idle_threads();
            Ok(())
        };
        if let Err(e) = self.on_ledger_runtime(self.deadline, fut).await {
            tracing::debug!(error = %e, "ledger memory give-back");
        }
    }

    async fn create_voucher(&self, voucher: &Voucher, now: Millis) -> Result<(), LedgerError> {
        self.creates.call((voucher.clone(), now)).await
    }

    async fn create_vouchers(
        &self,
        vouchers: &[(Voucher, Millis)],
    ) -> Result<Vec<Result<(), LedgerError>>, LedgerError> {
        let vouchers = vouchers.to_vec();
        self.run(move |l| async move { l.create_vouchers(&vouchers).await })
            .await
    }

    async fn voucher(&self, code: &str) -> Result<Option<Voucher>, LedgerError> {
        self.reads.call(code.to_string()).await
    }

    async fn vouchers(&self, codes: &[String]) -> Result<Vec<Voucher>, LedgerError> {
        let codes = codes.to_vec();
        self.run(move |l| async move { l.vouchers(&codes).await })
            .await
    }

    async fn voucher_stock(&self, code: &str) -> Result<Option<(Voucher, i64)>, LedgerError> {
        let code = code.to_string();
        self.run(move |l| async move { l.voucher_stock(&code).await })
            .await
    }

    async fn update_voucher(
        &self,
        code: &str,
        patch: &VoucherPatch,
    ) -> Result<(Voucher, Option<Restock>), LedgerError> {
        let (code, patch) = (code.to_string(), patch.clone());
        self.run(move |l| async move { l.update_voucher(&code, &patch).await })
            .await
    }

    async fn grant(
        &self,
        code: &str,
        node: &str,
        want: i64,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Grant, LedgerError> {
        self.grants
            .call(GrantAsk {
                code: code.to_string(),
                node: node.to_string(),
                want,
                now,
                ttl_ms,
            })
            .await
    }

    async fn open(&self, ask: &OpenAsk) -> Result<Opened, LedgerError> {
        self.opens.call(ask.clone()).await
    }

    async fn grant_many(
        &self,
        asks: &[GrantAsk],
    ) -> Result<Vec<Result<Grant, LedgerError>>, LedgerError> {
        let asks = asks.to_vec();
        self.run(move |l| async move { l.grant_many(&asks).await })
            .await
    }

    async fn renew(
        &self,
        lease_ids: &[i64],
        node: &str,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Vec<i64>, LedgerError> {
        let (ids, node) = (lease_ids.to_vec(), node.to_string());
        self.run(move |l| async move { l.renew(&ids, &node, now, ttl_ms).await })
            .await
    }

    async fn active_leases(&self, code: &str, node: &str) -> Result<Vec<i64>, LedgerError> {
        let (code, node) = (code.to_string(), node.to_string());
        self.run(move |l| async move { l.active_leases(&code, &node).await })
            .await
    }

    async fn return_lease(
        &self,
        lease_id: i64,
        now: Millis,
    ) -> Result<Option<Restock>, LedgerError> {
        self.returns.call((lease_id, now)).await
    }

    async fn return_leases(
        &self,
        leases: &[(i64, Millis)],
    ) -> Result<Vec<Option<Restock>>, LedgerError> {
        let leases = leases.to_vec();
        self.run(move |l| async move { l.return_leases(&leases).await })
            .await
    }

    async fn return_node_leases(
        &self,
        node: &str,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        let node = node.to_string();
        self.run(move |l| async move { l.return_node_leases(&node, now).await })
            .await
    }

    async fn register_node(
        &self,
        name: &str,
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Incarnation, LedgerError> {
        let name = name.to_string();
        self.run(move |l| async move { l.register_node(&name, now, dead_after_ms).await })
            .await
    }

    async fn heartbeat(
        &self,
        holder: &str,
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Beat, LedgerError> {
        // Not through the breaker: a node that cannot beat is taken for dead by the others, so
        // its beats go out whatever the breaker says. A beat later than a third of the limit
        // is worth nothing: it gives up then.
        let (holder, inner) = (holder.to_string(), self.inner.clone());
        let deadline = std::time::Duration::from_millis((dead_after_ms / 3).max(10) as u64);
        let store = inner.clone();
        let beat = self
            .on_ledger_runtime(deadline, async move {
                inner.heartbeat(&holder, now, dead_after_ms).await
            })
            .await;
        if super::breaker::is_outage(&beat) {
            store.lost();
        }
        beat
    }

    async fn reap_holder(&self, holder: &str, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        let holder = holder.to_string();
        self.run(move |l| async move { l.reap_holder(&holder, now).await })
            .await
    }

    async fn retire_node(&self, holder: &str) -> Result<(), LedgerError> {
        let holder = holder.to_string();
        self.run(move |l| async move { l.retire_node(&holder).await })
            .await
    }

    async fn commit_batch(&self, batch: &Batch) -> Result<Vec<RowOutcome>, LedgerError> {
        // Refused at once while open and cooling down; after that the merged transaction is
        // admitted (perhaps as the probe) and records itself, once.
        if self.breaker.refuses(self.breaker.now_ms()) {
            return Err(LedgerError::CircuitOpen);
        }
        self.committer.commit(batch.clone()).await
    }

    async fn commit_batches(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        let batches = batches.to_vec();
        self.run(move |l| async move { l.commit_batches(&batches).await })
            .await
    }

    async fn find_orders(&self, order_ids: &[String]) -> Result<Vec<Reservation>, LedgerError> {
        let ids = order_ids.to_vec();
        self.run(move |l| async move { l.find_orders(&ids).await })
            .await
    }

    async fn live_units(
        &self,
        now: Millis,
        ending_after: Millis,
        codes: &[String],
    ) -> Result<Vec<LiveUnits>, LedgerError> {
        let codes = codes.to_vec();
        self.run(move |l| async move { l.live_units(now, ending_after, &codes).await })
            .await
    }

    async fn starting_between(&self, from: Millis, to: Millis) -> Result<Vec<String>, LedgerError> {
        self.run(move |l| async move { l.starting_between(from, to).await })
            .await
    }

    async fn feed_origin(&self) -> Result<String, LedgerError> {
        self.run(move |l| async move { l.feed_origin().await })
            .await
    }

    async fn events(&self, after: i64, limit: i64) -> Result<Vec<FeedEvent>, LedgerError> {
        self.run(move |l| async move { l.events(after, limit).await })
            .await
    }

    async fn switches(&self) -> Result<Switches, LedgerError> {
        self.run(move |l| async move { l.switches().await }).await
    }

    async fn set_switches(
        &self,
        patch: &SwitchesPatch,
        now: Millis,
    ) -> Result<Switches, LedgerError> {
        let patch = *patch;
        self.run(move |l| async move { l.set_switches(&patch, now).await })
            .await
    }

    async fn won_orders(&self, code: &str) -> Result<Vec<(String, i64)>, LedgerError> {
        let code = code.to_string();
        self.run(move |l| async move { l.won_orders(&code).await })
            .await
    }

    async fn customer_usage(
        &self,
        code: &str,
        customers: &[i64],
    ) -> Result<Vec<(i64, i64)>, LedgerError> {
        let (code, customers) = (code.to_string(), customers.to_vec());
        self.run(move |l| async move { l.customer_usage(&code, &customers).await })
            .await
    }

    async fn confirm(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<Reservation, LedgerError> {
        let (code, order) = (code.to_string(), order_id.to_string());
        self.run(move |l| async move { l.confirm(&code, &order, now).await })
            .await
    }

    async fn release(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<(Reservation, Option<Restock>), LedgerError> {
        let (code, order) = (code.to_string(), order_id.to_string());
        self.run(move |l| async move { l.release(&code, &order, now).await })
            .await
    }

    async fn expire_due(&self, now: Millis, limit: i64) -> Result<Vec<Restock>, LedgerError> {
        self.run(move |l| async move { l.expire_due(now, limit).await })
            .await
    }

    async fn reap_expired(&self, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        self.run(move |l| async move { l.reap_expired(now).await })
            .await
    }

    async fn counters_many(&self, codes: &[String]) -> Result<Vec<Option<Counters>>, LedgerError> {
        let codes = codes.to_vec();
        self.run(move |l| async move { l.counters_many(&codes).await })
            .await
    }

    async fn voucher_codes(
        &self,
        ending_after: Millis,
        after: &str,
        limit: i64,
    ) -> Result<Vec<String>, LedgerError> {
        let after = after.to_string();
        self.run(move |l| async move { l.voucher_codes(ending_after, &after, limit).await })
            .await
    }

    async fn codes_created_since(&self, since: Millis) -> Result<Vec<String>, LedgerError> {
        self.run(move |l| async move { l.codes_created_since(since).await })
            .await
    }

    async fn watched_codes(&self) -> Result<Vec<String>, LedgerError> {
        self.run(|l| async move { l.watched_codes().await }).await
    }

    async fn set_watched(&self, code: &str, watched: bool) -> Result<(), LedgerError> {
        let code = code.to_string();
        self.run(move |l| async move { l.set_watched(&code, watched).await })
            .await
    }
}

/// `call` within `deadline`, else `Deadline`.
async fn within<T>(
    deadline: std::time::Duration,
    call: impl Future<Output = Result<T, LedgerError>>,
) -> Result<T, LedgerError> {
    tokio::time::timeout(deadline, call)
        .await
        .unwrap_or(Err(LedgerError::Deadline))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::ledger::model::ModelLedger;

    fn node_ledger() -> NodeLedger {
        NodeLedger::start(
            Arc::new(ModelLedger::new("test")),
            Handle::current(),
            &crate::config::Settings::defaults().ledger,
        )
    }

    /// A call that does not answer in time, and one whose task dies, say so: the breaker counts
    /// both as the ledger out of reach.
    #[tokio::test]
    async fn a_late_call_passes_its_deadline_and_a_dead_one_is_worker_gone() {
        let l = node_ledger();
        let late = l
            .on_ledger_runtime(
                Duration::from_millis(10),
                std::future::pending::<Result<(), LedgerError>>(),
            )
            .await;
        assert!(matches!(late, Err(LedgerError::Deadline)), "{late:?}");
        let dead = l
            .on_ledger_runtime(Duration::from_secs(10), async {
                panic!("the call's task dies");
                #[allow(unreachable_code)]
                Ok::<(), LedgerError>(())
            })
            .await;
        assert!(matches!(dead, Err(LedgerError::WorkerGone)), "{dead:?}");
        assert!(l.ping().await.is_ok(), "the ledger itself still answers");
    }
}
