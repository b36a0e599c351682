//! Operators' calls: the vouchers (create, edit, the admin view with its counters), warm-up and
//! pre-heat, the emergency switches and the change feed.

use std::sync::atomic::Ordering;

use tokio::sync::oneshot;

use super::actor::{Reload, Warm};
use super::{EngineError, EngineHandle};
use crate::domain::{FeedEvent, Switches, SwitchesPatch, Voucher, VoucherPatch};
use crate::ledger::Counters;
use crate::signals::Signal;

/// The "code" the `SWITCHES` signal travels under (no voucher code contains `~`).
const SWITCHES_CHANNEL: &str = "~switches";

/// A voucher with its live counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VoucherView {
    pub voucher: Voucher,
    pub counters: Counters,
}

impl VoucherView {
    pub fn sold_out(&self) -> bool {
        self.counters.free + self.counters.leased_unused == 0
    }
}

impl EngineHandle {
    pub async fn voucher(&self, code: &str) -> Result<VoucherView, EngineError> {
        let voucher = self
            .node
            .ledger
            .voucher(code)
            .await?
            .ok_or(EngineError::NotFound)?;
        let counters = self
            .node
            .ledger
            .counters(code)
            .await?
            .ok_or(EngineError::NotFound)?;
        Ok(VoucherView { voucher, counters })
    }

    pub async fn create_voucher(&self, v: &Voucher) -> Result<(), EngineError> {
        self.node.ledger.create_voucher(v, self.now_ms()).await?;
        // Not marked for a recount: a new voucher's books are its row alone (all free, no lease,
        // no reservation), and its first lease or reserve marks it. Marking every create queued
        // a campaign's codes for recounts with nothing in them: 1,000,000 creates held about
        // 85 MB of queue for the half hour the recounts took, and queued the sale's own
        // vouchers behind them. The catalogue's audit still reads it in its round.
        self.node.known.insert(&v.code);
        // Other nodes learn the code now rather than at their next re-read.
        self.node.signals.publish(&v.code, Signal::Updated);
        Ok(())
    }

    pub async fn update_voucher(
        &self,
        code: &str,
        patch: &VoucherPatch,
    ) -> Result<Voucher, EngineError> {
        let (voucher, restock) = self.node.ledger.update_voucher(code, patch).await?;
        self.node.changed(code);
        if let Some(e) = self.node.registry.get(code) {
            let _ = e.addr.try_send(Reload(voucher.clone()));
        }
        self.node.signals.publish(code, Signal::Updated);
        self.after_restocks(restock.into_iter());
        Ok(voucher)
    }

    /// The ledger's feed origin (see [`crate::ledger::Ledger::feed_origin`]).
    pub async fn feed_origin(&self) -> Result<String, EngineError> {
        Ok(self.node.ledger.feed_origin().await?)
    }

    /// The change feed after `after`, at most `limit` events (`GET /admin/events`).
    pub async fn events(&self, after: i64, limit: i64) -> Result<Vec<FeedEvent>, EngineError> {
        Ok(self.node.ledger.events(after, limit).await?)
    }

    /// Watches the voucher (its live numbers are exported on every node whatever its traffic)
    /// or stops watching it. Held by the ledger: every node's next live numbers follow.
    pub async fn watch(&self, code: &str, watched: bool) -> Result<(), EngineError> {
        Ok(self.node.ledger.set_watched(code, watched).await?)
    }

    /// Warms the voucher on this node and tells every other node to do the same (`WARM`).
    pub async fn warm_everywhere(&self, code: &str) -> Result<(), EngineError> {
        self.warm(code).await?;
        self.node.signals.publish(code, Signal::Warm);
        Ok(())
    }

    /// Pre-heat: warms, on this node, every voucher whose sale starts within
    /// `engine.preheat_ms`, so the first second of the sale is served from leases. Every node
    /// runs it (jobs), so every node is warm. Returns how many vouchers it warmed.
    pub async fn preheat(&self) -> Result<usize, EngineError> {
        let lead = self.node.settings.preheat_ms;
        if lead <= 0 {
            return Ok(0);
        }
        let now = self.now_ms();
        let codes = self.node.ledger.starting_between(now, now + lead).await?;
        if !codes.is_empty() {
            // A give-back (caches shrunk) waits until the sale's first seconds are over.
            self.node.give_back.hold_for_sale(now);
        }
        // The codes come from the ledger: no existence read per code.
        let warmed = futures_util::future::join_all(codes.iter().map(|c| self.warm_actor(c))).await;
        for (code, res) in codes.iter().zip(&warmed) {
            if let Err(e) = res {
                tracing::warn!(code = %code, error = %e, "pre-heat");
            }
        }
        Ok(warmed.iter().filter(|r| r.is_ok()).count())
    }

    /// Starts the voucher's actor on this node and waits until it holds its first lease.
    pub async fn warm(&self, code: &str) -> Result<(), EngineError> {
        if self.node.ledger.voucher(code).await?.is_none() {
            return Err(EngineError::NotFound);
        }
        self.warm_actor(code).await
    }

    /// Starts the actor of a voucher known to exist and waits until it holds its first lease.
    async fn warm_actor(&self, code: &str) -> Result<(), EngineError> {
        self.node.known.insert(code);
        let entry = self.node.warm_entry(code);
        let (tx, rx) = oneshot::channel();
        entry
            .addr
            .try_send(Warm(tx))
            .map_err(|_| EngineError::Unavailable)?;
        match tokio::time::timeout(self.node.request_timeout, rx).await {
            Ok(Ok(res)) => res,
            _ => Err(EngineError::Unavailable),
        }
    }

    /// The emergency switches as this node applies them now.
    pub fn switches(&self) -> Switches {
        let version = *self
            .node
            .switch_version
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        Switches {
            sales_paused: self.node.sales_paused.load(Ordering::Acquire),
            read_only: self.node.read_only.load(Ordering::Acquire),
            version,
        }
    }

    /// Changes the switches in the ledger (every node reads them from there within
    /// `jobs.switches_interval_ms`), applies them here at once and signals the cluster.
    pub async fn set_switches(&self, patch: &SwitchesPatch) -> Result<Switches, EngineError> {
        let s = self.node.ledger.set_switches(patch, self.now_ms()).await?;
        self.node.apply_switches(s);
        tracing::warn!(
            sales_paused = s.sales_paused,
            read_only = s.read_only,
            "switches set"
        );
        self.node
            .signals
            .publish(SWITCHES_CHANNEL, Signal::Switches);
        Ok(s)
    }

    /// Reads the switches from the ledger and applies them.
    pub async fn refresh_switches(&self) -> Result<Switches, EngineError> {
        let s = self.node.ledger.switches().await?;
        self.node.apply_switches(s);
        Ok(s)
    }
}
