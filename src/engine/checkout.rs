//! The checkout path: reserve (rate limits, the known-codes check, the sold-out short-circuit,
//! the hand-over to the voucher's actor), and confirm, release and the reservation and public
//! voucher reads, which go to the ledger directly.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix::dev::SendError;
use tokio::sync::oneshot;

use super::actor::Reserve;
use super::known::Known;
use super::limits::Limited;
use super::node::{code_hash, Entry, Gate};
use super::soldout::{SoldOutVerdict, VoucherShared};
use super::{error_outcome, outcome_of, EngineError, EngineHandle};
use crate::clock::Millis;
use crate::domain::{Ineligible, Reservation, ReserveRequest, Voucher};
use crate::ledger::{LedgerError, SharedLedger};
use crate::metrics::{self as m, Outcome};

/// A successful reserve: the reservation and whether it was a retry of an earlier one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    pub reservation: Reservation,
    pub replayed: bool,
}

/// Answers reserves that no lease unit can serve (the voucher is sold out here, not eligible
/// now, or the switches stop new sales) with DESIGN §4's precedence, from the ledger's rows: a
/// retry of a stored order of the same customer gets its `201`; then `503` if the node is
/// read-only; then `422` if the voucher (as `voucher` says) or the sales-paused switch refuses
/// the order; then `409 ALREADY_USED` (the order id is taken, or the customer is at their
/// limit); else `409 OUT_OF_STOCK`. Two ledger reads at most, for all of `reqs` at once.
pub(crate) async fn settle_without_units(
    ledger: &SharedLedger,
    code: &str,
    voucher: Option<&Voucher>,
    now: Millis,
    reqs: &[ReserveRequest],
    gate: Gate,
) -> Result<Vec<Result<Reserved, EngineError>>, LedgerError> {
    let ids: Vec<String> = reqs.iter().map(|r| r.order_id.clone()).collect();
    let found: HashMap<String, Reservation> = ledger
        .find_orders_for(code, &ids)
        .await?
        .into_iter()
        .map(|r| (r.order_id.clone(), r))
        .collect();
    let refusal = |req: &ReserveRequest| {
        voucher
            .and_then(|v| v.check_eligible(now, req.order_amount).err())
            .or((gate == Gate::SalesPaused).then_some(Ineligible::Paused))
    };
    let mut customers: Vec<i64> = reqs
        .iter()
        .filter(|r| {
            !found.contains_key(&r.order_id) && refusal(r).is_none() && gate != Gate::ReadOnly
        })
        .map(|r| r.customer_id)
        .collect();
    customers.sort_unstable();
    customers.dedup();
    let used: HashMap<i64, i64> = match (voucher, customers.is_empty()) {
        (Some(_), false) => ledger
            .customer_usage(code, &customers)
            .await?
            .into_iter()
            .collect(),
        _ => HashMap::new(),
    };
    let limit = voucher.map_or(i64::MAX, |v| v.per_user_limit);
    Ok(reqs
        .iter()
        .map(|req| match (found.get(&req.order_id), refusal(req)) {
            _ if voucher.is_some_and(|v| v.refuses_amount(req.order_amount)) => {
                Err(EngineError::NotEligible(Ineligible::MinOrderAmount))
            }
            (Some(r), _) if r.is_retry_of(code, req.customer_id, now) => Ok(Reserved {
                reservation: r.clone(),
                replayed: true,
            }),
            _ if gate == Gate::ReadOnly => Err(EngineError::Unavailable),
            (_, Some(reason)) => Err(EngineError::NotEligible(reason)),
            (Some(_), None) => Err(EngineError::AlreadyUsed),
            (None, None) if used.get(&req.customer_id).is_some_and(|&n| n >= limit) => {
                Err(EngineError::AlreadyUsed)
            }
            (None, None) => Err(EngineError::OutOfStock),
        })
        .collect())
}

/// The frontend's answer to a reserve from a sold-out voucher's flag (DESIGN §4's precedence,
/// with the switches after a possible retry's `201`), or `None` when only the ledger can tell
/// (an order that may have won, a customer who may be at their limit).
pub(crate) fn answer_from_flag(
    verdict: SoldOutVerdict,
    gate: Gate,
) -> Option<Result<Reserved, EngineError>> {
    Some(match verdict {
        SoldOutVerdict::NotEligible(Ineligible::MinOrderAmount) => {
            Err(EngineError::NotEligible(Ineligible::MinOrderAmount))
        }
        SoldOutVerdict::NotEligible(_)
        | SoldOutVerdict::AlreadyUsed
        | SoldOutVerdict::OutOfStock
            if gate == Gate::ReadOnly =>
        {
            Err(EngineError::Unavailable)
        }
        SoldOutVerdict::AlreadyUsed | SoldOutVerdict::OutOfStock if gate == Gate::SalesPaused => {
            Err(EngineError::NotEligible(Ineligible::Paused))
        }
        SoldOutVerdict::OutOfStock => Err(EngineError::OutOfStock),
        SoldOutVerdict::NotEligible(reason) => Err(EngineError::NotEligible(reason)),
        SoldOutVerdict::AlreadyUsed => Err(EngineError::AlreadyUsed),
        SoldOutVerdict::AskLedger | SoldOutVerdict::MaybeAtLimit => return None,
    })
}

/// Counts a reserve as waiting for its actor while alive.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn enter(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a rate-limit refusal and turns it into the engine's answer.
fn rate_limited(l: Limited) -> EngineError {
    m::rate_limited(l.limiter.label());
    EngineError::RateLimited {
        retry_after_secs: l.retry_after.as_secs_f64().ceil().max(1.0) as u64,
    }
}

impl EngineHandle {
    /// Reads every voucher code into memory (start-up). On failure the first request for an
    /// unknown code tries again.
    pub async fn load_known_codes(&self) {
        match self.node.known.load(&self.node.ledger, self.now_ms()).await {
            Ok(()) => tracing::info!(codes = self.node.known.len(), "voucher codes loaded"),
            Err(e) => tracing::warn!(error = %e, "could not load voucher codes yet"),
        }
    }

    /// `404` from memory for a code that does not exist; `503` when that cannot be told.
    ///
    /// While reserves of real vouchers wait on this node, the `404` comes after
    /// `engine.unknown_code_tarpit_ms`: each junk connection then gets one answer per interval
    /// (the request was still parsed), so a bot's connections cannot crowd out real checkouts.
    /// An idle node answers at once.
    async fn known(&self, code: &str) -> Result<(), EngineError> {
        match self
            .node
            .known
            .check(code, &self.node.ledger, self.now_ms())
            .await
        {
            Known::Yes => Ok(()),
            Known::No => {
                let tarpit = self.node.settings.unknown_code_tarpit_ms;
                if tarpit > 0 && self.node.in_flight.load(Ordering::Relaxed) > 0 {
                    tokio::time::sleep(Duration::from_millis(tarpit)).await;
                }
                Err(EngineError::NotFound)
            }
            Known::Unknown => Err(EngineError::Unavailable),
        }
    }

    /// Reserves one unit for an order. A sold-out voucher is answered from memory, except for
    /// orders that may have won, which the ledger answers.
    ///
    /// Outcomes are counted where they are decided: here for what the frontend answers itself,
    /// in the actor for the rest (once per batch where there is one).
    ///
    /// DESIGN §4's precedence starts here: rate limits first (per `client` address, then, for a
    /// code that exists, per customer and per voucher), all in memory and changing nothing.
    pub async fn reserve(
        &self,
        code: &str,
        req: ReserveRequest,
        client: Option<IpAddr>,
    ) -> Result<Reserved, EngineError> {
        if let Some(ip) = client {
            self.node.limits.address(ip).map_err(rate_limited)?;
        }
        if let Err(e) = self.known(code).await {
            m::reservation(error_outcome(&e));
            return Err(e);
        }
        let mut entry = self.node.entry(code);
        let res = self.reserve_on(code, req, &mut entry).await;
        entry.shared.count_outcome(outcome_of(&res));
        res
    }

    /// [`EngineHandle::reserve`] for a code that exists, from its per-customer and per-voucher
    /// limits on; `entry` ends as the registry row that answered.
    async fn reserve_on(
        &self,
        code: &str,
        req: ReserveRequest,
        entry: &mut Entry,
    ) -> Result<Reserved, EngineError> {
        let own = entry.shared.own_limits();
        let limits = &self.node.limits;
        limits
            .customer(code_hash(code), req.customer_id, own.as_deref())
            .map_err(rate_limited)?;
        limits
            .admit(entry.admission.as_deref(), own.as_deref())
            .map_err(rate_limited)?;
        for attempt in 0..3 {
            if attempt > 0 {
                // The actor stopped: its successor's row.
                *entry = self.node.entry(code);
            }
            let now = self.now_ms();
            if self.node.signals_up.load(Ordering::Acquire)
                && entry
                    .shared
                    .trusted(now, self.node.settings.soldout_probe_ms)
            {
                m::sold_out_short_circuit();
                entry.shared.count_short_circuit(now);
                let res = self.answer_sold_out(code, &req, &entry.shared, now).await;
                m::reservation(outcome_of(&res));
                return res;
            }
            if self.ledger_refused(code) {
                m::reservation(Outcome::Unavailable);
                return Err(EngineError::Unavailable);
            }
            let (tx, rx) = oneshot::channel();
            match entry.addr.try_send(Reserve {
                req: req.clone(),
                reply: tx,
            }) {
                Ok(()) => {}
                Err(SendError::Full(_)) => {
                    m::mailbox_full();
                    m::reservation(Outcome::Unavailable);
                    return Err(EngineError::Unavailable);
                }
                Err(SendError::Closed(_)) => {
                    // The actor stopped after idleness: start a fresh one.
                    self.node.forget(code, entry.generation);
                    continue;
                }
            }
            let _waiting = Waiting::enter(&self.node.in_flight);
            return match tokio::time::timeout(self.node.request_timeout, rx).await {
                Ok(Ok(reply)) => reply,
                // The actor stopped without answering. Asking again is safe: a reserve is
                // idempotent by order id, so one that did commit comes back as its 201.
                Ok(Err(_)) => {
                    self.node.forget(code, entry.generation);
                    continue;
                }
                Err(_) => {
                    m::reservation(Outcome::Unavailable);
                    Err(EngineError::Unavailable)
                }
            };
        }
        m::reservation(Outcome::Unavailable);
        Err(EngineError::Unavailable)
    }

    /// DESIGN §4's precedence from memory where it can tell, from the ledger where only the
    /// ledger can (an order that may have won, a customer who may be at their limit).
    async fn answer_sold_out(
        &self,
        code: &str,
        req: &ReserveRequest,
        shared: &VoucherShared,
        now: Millis,
    ) -> Result<Reserved, EngineError> {
        let gate = self.node.gate();
        match answer_from_flag(shared.sold_out_verdict(now, req), gate) {
            Some(answer) => answer,
            None => {
                let voucher = shared.voucher();
                let mut answers = settle_without_units(
                    &self.node.ledger,
                    code,
                    voucher.as_deref(),
                    now,
                    std::slice::from_ref(req),
                    gate,
                )
                .await?;
                answers.pop().unwrap_or(Err(EngineError::OutOfStock))
            }
        }
    }

    /// The circuit breaker `code`'s calls pass (the node's, or its shard's) is open and cooling
    /// down (or probing): a new reserve would only fail later. Once it has cooled down,
    /// reserves go through, and the first batch probes.
    fn ledger_refused(&self, code: &str) -> bool {
        self.node.ledger.refuses(code)
    }

    /// Confirm and release first read the reservation: made-up order ids get `404` from that read
    /// and never take the ledger's writer (on SQLite the one connection every commit needs).
    pub async fn confirm(&self, code: &str, order_id: &str) -> Result<Reservation, EngineError> {
        self.reservation(code, order_id).await?;
        // Past the read: it takes the writer.
        self.node.give_back.wrote();
        let r = self
            .node
            .ledger
            .confirm(code, order_id, self.now_ms())
            .await?;
        self.node.changed(code);
        Ok(r)
    }

    pub async fn release(&self, code: &str, order_id: &str) -> Result<Reservation, EngineError> {
        self.reservation(code, order_id).await?;
        // Past the read: it takes the writer.
        self.node.give_back.wrote();
        let (r, restock) = self
            .node
            .ledger
            .release(code, order_id, self.now_ms())
            .await?;
        self.after_restocks(restock.into_iter());
        Ok(r)
    }

    pub async fn reservation(
        &self,
        code: &str,
        order_id: &str,
    ) -> Result<Reservation, EngineError> {
        self.known(code).await?;
        let found = self
            .node
            .ledger
            .find_orders_for(code, &[order_id.to_string()])
            .await?;
        found
            .into_iter()
            .find(|r| r.voucher_code == code)
            .ok_or(EngineError::NotFound)
    }

    /// The public view: the voucher and whether nothing is left to sell (one ledger read).
    pub async fn public_voucher(&self, code: &str) -> Result<(Voucher, bool), EngineError> {
        self.known(code).await?;
        let (voucher, available) = self
            .node
            .ledger
            .voucher_stock(code)
            .await?
            .ok_or(EngineError::NotFound)?;
        Ok((voucher, available == 0))
    }
}
