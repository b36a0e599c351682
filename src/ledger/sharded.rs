//! The ledger in shards: each voucher on one PostgreSQL ledger of several, found through a
//! directory on the first (docs/DESIGN.md, "Shards").
//!
//! [`ShardedLedger`] is a [`Ledger`] over one ledger per shard (each the node's wrapped ledger
//! of its own, with its own pool, breaker and group committer), so no transaction ever spans
//! shards. A call about one voucher goes to its shard; a call about many is split by shard
//! and answered in the caller's order; a call about the node or the whole catalogue goes to
//! every shard. Lease ids are the shard's own with the shard in their low bits, so that a
//! renew, a return or a batch finds its shard from the id alone. The change feed is every
//! shard's, merged on the directory and numbered again without gaps.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::{join_all, try_join_all};

use super::breaker::Breaker;
use super::coalesce::{Coalescer, ManyFn};
use super::postgres::commit::claims_began;
use super::postgres::directory::{ClaimStart, MISPLACED, NOT_EMPTY};
use super::postgres::{Pending, PostgresLedger};
use super::{
    Batch, BatchResults, Beat, Counters, Grant, GrantAsk, Incarnation, Lease, Ledger, LedgerError,
    LiveUnits, OpenAsk, Opened, Restock, RowOutcome, SharedLedger,
};
use crate::clock::Millis;
use crate::domain::{
    FeedEvent, Ineligible, Reservation, Switches, SwitchesPatch, Voucher, VoucherPatch,
};

/// Bits of a lease id that name its shard.
const SHARD_BITS: u32 = 8;
/// Most shards a ledger may have.
pub const MAX_SHARDS: usize = 1 << SHARD_BITS;
/// Why a node that stores without claims is not ready once claims began.
const OUTRUN: &str = "order claims began after this node started without them: restart it";
/// Why a shard's answer is no answer: it does not cover every batch or row sent.
const SHORT_ANSWER: &str = "a shard answered fewer rows than were sent";
/// Events of each shard copied into the merged feed per read of it.
const MERGE_PAGE: i64 = 1_000;

/// One ledger per shard, and the directory (see the module doc).
pub struct ShardedLedger {
    /// The shards, in the order `ledger.shards` lists them (each database knows its place).
    shards: Vec<SharedLedger>,
    /// Each shard's store under its node's wrapping: whether it is open yet (one down when the
    /// node started is opened when it is back).
    stores: Vec<Arc<PostgresLedger>>,
    /// The first shard's store, for the directory and the merged feed.
    directory: Arc<PostgresLedger>,
    /// Where the directory placed each voucher asked about so far: a voucher never moves yet
    /// (epoch 1), so a placement once read holds.
    placed: RwLock<HashMap<String, usize>>,
    /// The merged feed's origin: the first shard's, marked.
    origin: String,
    /// The commits' order claims, merged into one statement on the directory per round
    /// ([`claims_merged`]); none with one shard, whose own commit keeps the order rule, or
    /// where the rule is kept per shard (`ledger.order_ids_across_shards = false`).
    claims: Option<Coalescer<ClaimAsk, HashSet<String>>>,
    /// The directory's own breaker, which its calls pass (the claims, which every commit passes
    /// while claims are made; placements, the catalogue, the merged feed): its failures say
    /// nothing of shard 0's vouchers, and shard 0's slow commits nothing of it.
    directory_breaker: Arc<Breaker>,
    /// This node stores orders without claims, and the directory has since begun them (a shard
    /// was added, or the setting turned on, by a node started later): it commits nothing more
    /// (`503`) until it is restarted, so that no order it stores escapes the claims.
    outrun: AtomicBool,
}

/// How a node keeps the order rule across shards.
#[derive(Debug, Clone, Copy)]
pub struct ClaimSettings {
    /// `ledger.order_ids_across_shards`.
    pub across_shards: bool,
    /// The directory's breaker: unreachable calls in a row that open it (0: never), and how long
    /// it stays open (`ledger.breaker_failures`, `ledger.breaker_open_ms`).
    pub breaker_failures: u32,
    pub breaker_open_ms: u64,
}

/// One commit call's claim: its distinct `(order id, voucher)` pairs.
type ClaimAsk = Vec<(String, String)>;

/// Claims merged into one call at most.
const MAX_MERGED_CLAIMS: usize = 1024;

/// The merged claim of many commit calls' `(order id, voucher)` pairs (each call's distinct):
/// an order carried to several vouchers goes to the first of them, in the calls' order, unless
/// the directory already gives it to another of them (a retry of an order stored on W joins
/// W's claim even when an earlier call of the round carried it to V). Three statements at most,
/// each through the directory's breaker within `deadline`: the first choices; where some were
/// refused, who holds those orders; the holders' claims joined. Each voucher's claim counts
/// every call that carries the order to it; each call gets the orders claimed or joined for its
/// own voucher. Once the first statement went through, a later one that fails fails only the
/// calls that needed it (their counts stay: safe, those orders are refused elsewhere).
fn claims_merged(
    directory: Arc<PostgresLedger>,
    breaker: Arc<Breaker>,
    deadline: Duration,
) -> ManyFn<Vec<(String, String)>, HashSet<String>> {
    Arc::new(move |asks: Vec<Vec<(String, String)>>| {
        let (directory, breaker) = (directory.clone(), breaker.clone());
        Box::pin(async move {
            // One budget for the round's statements, inside the coalescer's own backstop.
            let until = tokio::time::Instant::now() + deadline;
            // Per order (sorted by id: every statement locks the claims in that order), its
            // vouchers in the order the calls carry them, each with its count of calls.
            let mut wanted: BTreeMap<&str, Vec<(&str, i64)>> = BTreeMap::new();
            for ask in &asks {
                for (order, code) in ask {
                    let choices = wanted.entry(order.as_str()).or_default();
                    match choices.iter_mut().find(|(c, _)| *c == code.as_str()) {
                        Some((_, n)) => *n += 1,
                        None => choices.push((code.as_str(), 1)),
                    }
                }
            }
            let firsts: Vec<(&str, &str, i64)> = wanted
                .iter()
                .map(|(o, choices)| (*o, choices[0].0, choices[0].1))
                .collect();
            let mut won: HashMap<&str, &str> = HashMap::with_capacity(wanted.len());
            for o in bounded(&breaker, until, claim_statement(&directory, &firsts)).await? {
                if let Some((o, choices)) = wanted.get_key_value(o.as_str()) {
                    won.insert(*o, choices[0].0);
                }
            }
            let refused: Vec<&str> = wanted
                .iter()
                .filter(|(o, choices)| choices.len() > 1 && !won.contains_key(*o))
                .map(|(o, _)| *o)
                .collect();
            let needs_join: HashSet<&str> = refused.iter().copied().collect();
            let mut joined: Result<(), LedgerError> = Ok(());
            if !refused.is_empty() {
                let holders =
                    bounded(&breaker, until, Box::pin(directory.claim_holders(&refused))).await;
                joined = match holders {
                    Ok(holders) => {
                        // The holder among any of the order's vouchers (it may have become
                        // the first choice's since the first statement).
                        let mut joins: Vec<(&str, &str, i64)> = holders
                            .iter()
                            .filter_map(|(o, holder)| {
                                let (o, choices) = wanted.get_key_value(o.as_str())?;
                                let (c, n) = choices.iter().find(|(c, _)| c == holder)?;
                                Some((*o, *c, *n))
                            })
                            .collect();
                        joins.sort_unstable();
                        let to: HashMap<&str, &str> = joins.iter().map(|j| (j.0, j.1)).collect();
                        bounded(&breaker, until, claim_statement(&directory, &joins))
                            .await
                            .map(|got| {
                                for o in got {
                                    if let Some((o, c)) = to.get_key_value(o.as_str()) {
                                        won.insert(*o, *c);
                                    }
                                }
                            })
                    }
                    Err(e) => Err(e),
                };
            }
            let joined = joined.map_err(Arc::new);
            Ok(asks
                .iter()
                .map(|ask| {
                    let needed = ask.iter().any(|(o, _)| needs_join.contains(o.as_str()));
                    match &joined {
                        Err(e) if needed => Err(LedgerError::CommitFailed(e.clone())),
                        _ => Ok(ask
                            .iter()
                            .filter(|(o, c)| won.get(o.as_str()) == Some(&c.as_str()))
                            .map(|(o, _)| o.clone())
                            .collect()),
                    }
                })
                .collect())
        })
    })
}

/// `call` through the directory's breaker, done by `until` (the round's deadline: a call that does
/// not answer in time counts against the breaker as any unreachable one).
async fn bounded<T>(
    breaker: &Breaker,
    until: tokio::time::Instant,
    call: Pending<'_, T>,
) -> Result<T, LedgerError> {
    breaker
        .call(async move {
            tokio::time::timeout_at(until, call)
                .await
                .unwrap_or(Err(LedgerError::Deadline))
        })
        .await
}

/// One claim statement for `asked` (order, voucher, calls), in order-id order: the orders
/// claimed or joined.
fn claim_statement<'a>(
    directory: &'a PostgresLedger,
    asked: &'a [(&'a str, &'a str, i64)],
) -> Pending<'a, Vec<String>> {
    Box::pin(async move {
        if asked.is_empty() {
            return Ok(Vec::new());
        }
        let orders: Vec<&str> = asked.iter().map(|a| a.0).collect();
        let codes: Vec<&str> = asked.iter().map(|a| a.1).collect();
        let counts: Vec<i64> = asked.iter().map(|a| a.2).collect();
        directory.claim_orders(&orders, &codes, &counts).await
    })
}

/// The server's refusals of a merged call's one statement, which roll its transaction back: a
/// deadlock victim, a serialization failure, a lock or statement timeout, the claims' fence
/// (and its isolation check), a call over the customers' lock bound, a full lock table, a
/// missing table or function. Any other code (and every lost connection, `Unreachable`) may
/// have come after the rows were stored.
fn rolled_back(code: &str) -> bool {
    matches!(
        code,
        "40P01"
            | "40001"
            | "55P03"
            | "57014"
            | "VC001"
            | "VC002"
            | "VC003"
            | "53200"
            | "42883"
            | "42P01"
    )
}

/// Whether a commit refused with `e` stored nothing: refused as a whole before its shard's
/// transaction was sent (a committer's breaker refusal comes back wrapped).
fn stored_nothing(e: &LedgerError) -> bool {
    match e {
        LedgerError::Fenced
        | LedgerError::NotFound
        | LedgerError::CircuitOpen
        | LedgerError::QueueFull => true,
        LedgerError::Database { code: Some(c), .. } => rolled_back(c),
        LedgerError::CommitFailed(inner) => {
            matches!(**inner, LedgerError::CircuitOpen | LedgerError::QueueFull)
                || matches!(&**inner, LedgerError::Database { code: Some(c), .. } if rolled_back(c))
                || matches!(&**inner, LedgerError::CommitFailed(_) if stored_nothing(inner))
        }
        _ => false,
    }
}

/// Checks that shard `i`'s database is at its place: the one it was given first, of this
/// directory (`first`), or none yet; only the first shard may bring vouchers of its own (a
/// single ledger before): another's would be in no directory.
async fn check_place(i: usize, store: &PostgresLedger, first: &str) -> Result<(), LedgerError> {
    placed_right(i, store.shard_place().await?, first)
}

/// [`check_place`] of what a database says of its place.
fn placed_right(
    i: usize,
    place: (Option<(i32, String)>, bool),
    first: &str,
) -> Result<(), LedgerError> {
    match place {
        (Some((s, of)), _) if (s, of.as_str()) != (i as i32, first) => {
            Err(LedgerError::Invalid(MISPLACED))
        }
        (None, true) if i > 0 => Err(LedgerError::Invalid(NOT_EMPTY)),
        _ => Ok(()),
    }
}

/// How often a shard that was down at start is tried again while it does not answer, and
/// after any other failure (said at `warn` each time).
const LATE_AGAIN: Duration = Duration::from_millis(250);
const LATE_FAILED_AGAIN: Duration = Duration::from_secs(10);

/// Opens shard `i`, down when the node started, once its server answers: checked at its place
/// (before anything is written there: a database of another cluster, or at another place, is
/// never migrated by this node), migrated, marked, fenced where the node claims its orders
/// (`claims`); until then every call to it fails as unreachable (its vouchers answer `503`). A
/// database refused at its place stays refused (logged; restart with the right list). Ends
/// when the store is dropped.
async fn open_late(store: std::sync::Weak<PostgresLedger>, i: usize, first: String, claims: bool) {
    let mut tries: u64 = 0;
    loop {
        tries += 1;
        let Some(s) = store.upgrade() else { return };
        let pause = match try_open(&s, i, &first, claims).await {
            Ok(()) => {
                s.opened();
                tracing::warn!(shard = i, "a shard that was down at start is open");
                return;
            }
            Err(e @ LedgerError::Invalid(_)) => {
                tracing::error!(
                    shard = i,
                    error = %e,
                    "a shard that was down at start is refused: its vouchers answer 503 until \
                     the node restarts with the right ledger.shards"
                );
                return;
            }
            Err(e @ (LedgerError::Unreachable { .. } | LedgerError::Deadline)) => {
                // Down still: said every ten seconds or so.
                if tries % 40 == 1 {
                    tracing::warn!(shard = i, error = %e, "a shard that was down at start is still down");
                }
                LATE_AGAIN
            }
            Err(e) => {
                tracing::warn!(shard = i, error = %e, "a shard that was down at start could not be opened");
                LATE_FAILED_AGAIN
            }
        };
        drop(s);
        tokio::time::sleep(pause).await;
    }
}

/// One try of [`open_late`] (boxed: the spawned task must be `Send` for every lifetime).
fn try_open<'a>(s: &'a PostgresLedger, i: usize, first: &'a str, claims: bool) -> Pending<'a, ()> {
    Box::pin(async move {
        // Its place first, before any migration: a fresh database has no tables yet (42P01),
        // so no place and no vouchers.
        match s.shard_place().await {
            Ok(place) => placed_right(i, place, first)?,
            Err(LedgerError::Database { code: Some(c), .. }) if c == "42P01" => {}
            Err(e) => return Err(e),
        }
        s.migrate_late().await?;
        check_place(i, s, first).await?;
        s.claim_shard(i as i32, first).await?;
        if claims {
            s.begin_claims().await?;
        }
        Ok(())
    })
}

impl ShardedLedger {
    /// Opens the sharded ledger over `shards` (each the node's ledger of a store in `stores`,
    /// in the same order): each database is checked to be at its place (all before any is
    /// marked), and the first made the directory. Claims are merged on `rt`, each round within
    /// `deadline`; where claims begin now, every shard's stored orders are claimed first.
    pub async fn open(
        stores: &[Arc<PostgresLedger>],
        shards: Vec<SharedLedger>,
        rt: &tokio::runtime::Handle,
        deadline: Duration,
        claim: ClaimSettings,
    ) -> Result<Self, LedgerError> {
        if stores.is_empty() || stores.len() != shards.len() || stores.len() > MAX_SHARDS {
            return Err(LedgerError::Invalid("ledger.shards lists 1 to 256 shards"));
        }
        let directory = stores[0].clone();
        if !directory.is_open() {
            return Err(LedgerError::Invalid(
                "the first shard (the directory) must be up for a node to start",
            ));
        }
        let first = directory.feed_origin().await?;
        // Shards down now (opened late) are checked and fenced when they come back.
        let up: Vec<(usize, &Arc<PostgresLedger>)> = stores
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_open())
            .collect();
        for (i, store) in &up {
            check_place(*i, store, &first).await?;
        }
        for (i, store) in &up {
            store.claim_shard(*i as i32, &first).await?;
        }
        let start = directory
            .open_directory(
                stores.len() as i32,
                claim.across_shards,
                up.len() == stores.len(),
            )
            .await?;
        match start {
            ClaimStart::Fill => {
                // Every shard fenced first (no commit without a claim lands there from then
                // on), then every shard's orders copied: none stored without a claim is missed.
                tracing::warn!("order claims begin: fencing every shard and copying its orders");
                try_join_all(stores.iter().map(|s| s.begin_claims())).await?;
                for (shard, store) in stores.iter().enumerate() {
                    let clashes = directory.fill_claims(store).await?;
                    if !clashes.is_empty() {
                        tracing::error!(
                            shard,
                            orders = clashes.len(),
                            first = ?&clashes[..clashes.len().min(20)],
                            "orders stored on two vouchers while no claims were made"
                        );
                    }
                }
                directory.claims_filled().await?;
            }
            // A node that claimed before: every shard fenced (again, at no cost: one that
            // was left out of a copy cannot take orders without claims from now on).
            ClaimStart::On => try_join_all(up.iter().map(|(_, s)| s.begin_claims()))
                .await
                .map(|_| ())?,
            ClaimStart::Off => {}
        }
        if start != ClaimStart::Off {
            stores.iter().for_each(|s| s.commit_claimed());
        }
        for (i, store) in stores.iter().enumerate().filter(|(_, s)| !s.is_open()) {
            tracing::warn!(
                shard = i,
                "a shard is down at start: its vouchers answer 503 until it is back"
            );
            rt.spawn(open_late(
                Arc::downgrade(store),
                i,
                first.clone(),
                start != ClaimStart::Off,
            ));
        }
        let directory_breaker = Arc::new(
            Breaker::new(claim.breaker_failures, claim.breaker_open_ms)
                .for_directory()
                .of_store(directory.clone()),
        );
        let claims = (start != ClaimStart::Off).then(|| {
            // The round's statements share `deadline`; the coalescer's is a backstop behind it,
            // so that a slow statement counts against the breaker and fails only its own calls.
            Coalescer::start(
                rt,
                MAX_MERGED_CLAIMS,
                deadline + Duration::from_secs(1),
                claims_merged(directory.clone(), directory_breaker.clone(), deadline),
            )
        });
        Ok(Self {
            shards,
            stores: stores.to_vec(),
            directory,
            placed: RwLock::new(HashMap::new()),
            origin: format!("{first}/merged"),
            claims,
            directory_breaker,
            outrun: AtomicBool::new(false),
        })
    }

    /// Whether shard `s` refuses calls now: down since the node started, or its breaker open.
    fn shard_down(&self, s: usize) -> bool {
        !self.stores[s].is_open() || self.shards[s].refuses("")
    }

    fn shard_count(&self) -> i32 {
        self.shards.len() as i32
    }

    /// The shard of `code`, if the directory placed it.
    async fn shard_of(&self, code: &str) -> Result<Option<usize>, LedgerError> {
        Ok(self
            .shards_of(std::slice::from_ref(&code.to_string()))
            .await?
            .pop()
            .flatten())
    }

    /// The shard of each of `codes`, in order (`None`: not placed).
    async fn shards_of(&self, codes: &[String]) -> Result<Vec<Option<usize>>, LedgerError> {
        let missing: Vec<String> = {
            let placed = self.placed.read().unwrap_or_else(|e| e.into_inner());
            codes
                .iter()
                .filter(|c| !placed.contains_key(*c))
                .cloned()
                .collect()
        };
        if !missing.is_empty() {
            let found = self.on_directory(self.directory.placed(&missing)).await?;
            let mut placed = self.placed.write().unwrap_or_else(|e| e.into_inner());
            for (code, shard) in found {
                if let Some(s) = self.index(shard) {
                    placed.insert(code, s);
                }
            }
        }
        let placed = self.placed.read().unwrap_or_else(|e| e.into_inner());
        Ok(codes.iter().map(|c| placed.get(c).copied()).collect())
    }

    /// A shard number from the directory, if this ledger has that shard.
    fn index(&self, shard: i32) -> Option<usize> {
        usize::try_from(shard)
            .ok()
            .filter(|s| *s < self.shards.len())
    }

    /// The shard of `code` and its ledger, or `NotFound`.
    async fn route(&self, code: &str) -> Result<(usize, &SharedLedger), LedgerError> {
        let s = self.shard_of(code).await?.ok_or(LedgerError::NotFound)?;
        Ok((s, &self.shards[s]))
    }

    /// Places `code` (or finds where it was placed), at `now`.
    async fn place(&self, code: &str, now: Millis) -> Result<usize, LedgerError> {
        let down: Vec<i32> = (0..self.shards.len())
            .filter(|s| self.shard_down(*s))
            .map(|s| s as i32)
            .collect();
        let shard = self
            .on_directory(self.directory.place(code, self.shard_count(), now, &down))
            .await?;
        let s = self
            .index(shard)
            .ok_or(LedgerError::Inconsistent("placed on a shard not listed"))?;
        self.placed
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(code.to_string(), s);
        Ok(s)
    }

    /// Splits `items` by the shard of each one's code: per shard, the positions and the items;
    /// and the positions of those with no shard.
    async fn split<'a, T>(
        &self,
        items: &'a [T],
        code: impl Fn(&T) -> &str,
    ) -> Result<(Vec<Vec<(usize, &'a T)>>, Vec<usize>), LedgerError> {
        let codes: Vec<String> = items.iter().map(|i| code(i).to_string()).collect();
        let shards = self.shards_of(&codes).await?;
        let mut by_shard: Vec<Vec<(usize, &T)>> = vec![Vec::new(); self.shards.len()];
        let mut unplaced = Vec::new();
        for (pos, (item, shard)) in items.iter().zip(shards).enumerate() {
            match shard {
                Some(s) => by_shard[s].push((pos, item)),
                None => unplaced.push(pos),
            }
        }
        Ok((by_shard, unplaced))
    }

    /// A call to the directory, through its breaker.
    async fn on_directory<T>(
        &self,
        call: impl Future<Output = Result<T, LedgerError>>,
    ) -> Result<T, LedgerError> {
        self.directory_breaker.call(call).await
    }

    /// Refuses a commit once claims began without this node (see `outrun`).
    fn not_outrun(&self) -> Result<(), LedgerError> {
        match self.outrun.load(Ordering::Acquire) {
            true => Err(LedgerError::CircuitOpen),
            false => Ok(()),
        }
    }

    /// A shard refused a commit without claims (its claims began): no more commits.
    fn outrun_by(&self, e: &LedgerError) {
        let began = match e {
            LedgerError::CommitFailed(inner) => claims_began(inner),
            e => claims_began(e),
        };
        if began && !self.outrun.swap(true, Ordering::AcqRel) {
            tracing::error!("{OUTRUN}");
        }
    }

    /// A node without claims, at each beat: once the directory has begun claims (a node
    /// started later with more shards, or with the setting on), this one stops committing.
    async fn check_claim_mode(&self) {
        match self.directory.claim_mode().await {
            Ok(Some(mode)) if mode != "off" => {
                if !self.outrun.swap(true, Ordering::AcqRel) {
                    tracing::error!("{OUTRUN}");
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not read the directory's claim mode"),
        }
    }

    /// Claims the order ids of `batches` for their vouchers (DESIGN §4: an order id is used on
    /// one voucher only, across shards), in slice order: a row whose order id another voucher
    /// holds goes no further and is answered `ALREADY_USED`.
    async fn claim(&self, batches: &[&Batch]) -> Result<Claims, LedgerError> {
        let mut first: HashMap<&str, &str> = HashMap::new();
        for b in batches {
            for r in &b.rows {
                first
                    .entry(r.order_id.as_str())
                    .or_insert(b.voucher_code.as_str());
            }
        }
        let granted: HashSet<String> = match &self.claims {
            // One shard: its own commit keeps the rule; every row goes to it.
            None => first.keys().map(|o| o.to_string()).collect(),
            Some(_) if first.is_empty() => HashSet::new(),
            Some(claims) => {
                let ask: Vec<(String, String)> = first
                    .iter()
                    .map(|(o, c)| (o.to_string(), c.to_string()))
                    .collect();
                // Through the directory's breaker, inside the merged call.
                claims.call(ask).await?
            }
        };
        let allowed = batches
            .iter()
            .map(|b| {
                b.rows
                    .iter()
                    .map(|r| {
                        let o = r.order_id.as_str();
                        granted.contains(o) && first.get(o) == Some(&b.voucher_code.as_str())
                    })
                    .collect()
            })
            .collect();
        Ok(Claims {
            claimed: if self.claims.is_some() {
                granted
            } else {
                HashSet::new()
            },
            allowed,
        })
    }

    /// Settles the claims of a commit call once its batches are answered: the call gives its
    /// count back on each order none of whose rows was stored (refused, or in a batch refused
    /// as a whole), and keeps it where one was, or may have been (a lost answer).
    async fn settle(
        &self,
        claims: &Claims,
        batches: &[&Batch],
        answers: &[Result<Vec<RowOutcome>, LedgerError>],
    ) {
        if claims.claimed.is_empty() {
            return;
        }
        let mut kept: HashMap<&str, bool> =
            claims.claimed.iter().map(|o| (o.as_str(), false)).collect();
        for (pos, (b, answer)) in batches.iter().zip(answers).enumerate() {
            let sent = b
                .rows
                .iter()
                .zip(&claims.allowed[pos])
                .filter(|(_, ok)| **ok)
                .map(|(r, _)| r.order_id.as_str());
            match answer {
                Ok(outcomes) => {
                    for (order, outcome) in sent.zip(outcomes) {
                        if matches!(outcome, RowOutcome::Created(_) | RowOutcome::Replayed(_)) {
                            kept.insert(order, true);
                        }
                    }
                }
                // Refused as a whole, or never sent: nothing of it was stored.
                Err(e) if stored_nothing(e) => {}
                Err(_) => sent.for_each(|order| {
                    kept.insert(order, true);
                }),
            }
        }
        let mut refused: Vec<&str> = kept
            .into_iter()
            .filter(|(_, kept)| !kept)
            .map(|(o, _)| o)
            .collect();
        if refused.is_empty() {
            return;
        }
        refused.sort_unstable();
        if let Err(e) = self
            .on_directory(self.directory.release_claims(&refused))
            .await
        {
            // The counts stay (a release whose answer was lost may have given them back, so it
            // is not tried again): those orders are refused on other vouchers, never taken
            // twice.
            tracing::warn!(orders = refused.len(), error = %e, "could not release order claims");
        }
    }

    /// Why batch `pos`'s voucher refused every new order at its commit, where rows of it were
    /// refused for another voucher's claim: from its shard's answers to the rows sent, else
    /// from the voucher.
    async fn blocked(
        &self,
        claims: &Claims,
        pos: usize,
        batch: &Batch,
        got: &[RowOutcome],
    ) -> Result<Option<Ineligible>, LedgerError> {
        if !claims.refused_any(pos) {
            return Ok(None);
        }
        if let Some(reason) = got.iter().find_map(|o| match o {
            RowOutcome::NotEligible(r) => Some(*r),
            _ => None,
        }) {
            return Ok(Some(reason));
        }
        let voucher = self.voucher(&batch.voucher_code).await?;
        Ok(voucher.and_then(|v| v.check_eligible(batch.now, i64::MAX).err()))
    }

    /// One round of [`Ledger::commit_batches`]: no two batches carry an order id to different
    /// vouchers.
    async fn commit_round(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        self.not_outrun()?;
        let (by_shard, _) = self.split(batches, |b| &b.voucher_code).await?;
        let all: Vec<&Batch> = batches.iter().collect();
        let claims = self.claim(&all).await?;
        let mut answers: BatchResults = (0..batches.len())
            .map(|_| Err(LedgerError::NotFound))
            .collect();
        let claims_ref = &claims;
        let parts = join_all(
            by_shard
                .into_iter()
                .enumerate()
                .map(|(s, part)| async move {
                    let mut local = Vec::with_capacity(part.len());
                    let mut fenced = Vec::new();
                    let mut kept = Vec::with_capacity(part.len());
                    let mut empty = Vec::new();
                    for (pos, b) in part {
                        let (lease_shard, id) = lease_in(b.lease_id);
                        if lease_shard != s {
                            fenced.push(pos);
                            continue;
                        }
                        let mut sent = claims_ref.sent(pos, b);
                        if sent.rows.is_empty() {
                            empty.push(pos);
                            continue;
                        }
                        sent.lease_id = id;
                        local.push(sent);
                        kept.push(pos);
                    }
                    let got = if local.is_empty() {
                        None
                    } else {
                        Some(self.shards[s].commit_batches(&local).await)
                    };
                    (kept, fenced, empty, got)
                }),
        )
        .await;
        let mut failed = None;
        let mut committed = false;
        for (kept, fenced, empty, got) in parts {
            for pos in fenced {
                answers[pos] = Err(LedgerError::Fenced);
            }
            for pos in empty {
                answers[pos] = Ok(Vec::new());
            }
            match got {
                None => {}
                Some(Ok(results)) if results.len() == kept.len() => {
                    committed = true;
                    for (pos, r) in kept.into_iter().zip(results) {
                        if let Err(e) = &r {
                            self.outrun_by(e);
                        }
                        answers[pos] = claims.checked(pos, r);
                    }
                }
                Some(got) => {
                    let e = got.err().unwrap_or(LedgerError::Inconsistent(SHORT_ANSWER));
                    self.outrun_by(&e);
                    let e = Arc::new(e);
                    for pos in kept {
                        answers[pos] = Err(LedgerError::CommitFailed(e.clone()));
                    }
                    failed.get_or_insert(e);
                }
            }
        }
        self.settle(&claims, &all, &answers).await;
        let mut done: BatchResults = Vec::with_capacity(answers.len());
        for (pos, r) in answers.into_iter().enumerate() {
            done.push(match r {
                Ok(rows) => {
                    // The shard's answers stand whatever this read finds.
                    let blocked = self.blocked(&claims, pos, &batches[pos], &rows).await;
                    Ok(claims.answers(pos, rows, blocked.unwrap_or(None)))
                }
                Err(e) => Err(e),
            });
        }
        let answers = done;
        if let (Some(e), false) = (failed, committed) {
            return Err(Arc::try_unwrap(e).unwrap_or_else(LedgerError::CommitFailed));
        }
        Ok(answers)
    }

    /// Calls `call(shard, items)` on every shard that has items in `by_shard` (each with its
    /// position in the caller's list), at once, and puts each answer at its item's position in
    /// `answers`; the first error fails it all.
    async fn gather<T: Clone, A, F, Fut>(
        &self,
        by_shard: Vec<Vec<(usize, T)>>,
        answers: &mut [A],
        call: F,
    ) -> Result<(), LedgerError>
    where
        F: Fn(usize, Vec<T>) -> Fut,
        Fut: Future<Output = Result<Vec<A>, LedgerError>>,
    {
        let parts = try_join_all(by_shard.into_iter().enumerate().map(|(s, part)| {
            let (positions, items): (Vec<usize>, Vec<T>) = part.into_iter().unzip();
            let asked = (!items.is_empty()).then(|| call(s, items));
            async move {
                match asked {
                    Some(asked) => Ok::<_, LedgerError>((positions, asked.await?)),
                    None => Ok((positions, Vec::new())),
                }
            }
        }))
        .await?;
        for (positions, got) in parts {
            for (pos, a) in positions.into_iter().zip(got) {
                answers[pos] = a;
            }
        }
        Ok(())
    }

    /// Calls `call(shard, codes)` on every shard that holds some of `codes` (those the
    /// directory places), at once; their answers in one list, or the first error. `lenient`
    /// (what the call is, for the log) takes the answers of the shards that answered instead,
    /// failing only when none did, for reads whose codes of a shard that is down may be left
    /// out (the live numbers).
    async fn by_code_shard<T, F, Fut>(
        &self,
        codes: &[String],
        lenient: Option<&str>,
        call: F,
    ) -> Result<Vec<T>, LedgerError>
    where
        F: Fn(usize, Vec<String>) -> Fut,
        Fut: Future<Output = Result<Vec<T>, LedgerError>>,
    {
        let (by_shard, _) = self.split(codes, |c| c).await?;
        let (shards, asked): (Vec<usize>, Vec<Fut>) = by_shard
            .into_iter()
            .enumerate()
            .filter(|(_, part)| !part.is_empty())
            .map(|(s, part)| {
                (
                    s,
                    call(s, part.into_iter().map(|(_, c)| c.clone()).collect()),
                )
            })
            .unzip();
        match lenient {
            None => Ok(flat(try_join_all(asked).await?)),
            Some(what) => {
                let got = join_all(asked).await;
                Ok(flat(answered_up(what, shards.into_iter().zip(got))?))
            }
        }
    }

    /// `call` on every shard at once, for the node's sweeps and beats: the answers of the
    /// shards that answered (a shard that is down stops only its own vouchers; its sweep runs
    /// again at the next round), an error only when none did.
    async fn each_up<'a, T, F, Fut>(&'a self, what: &str, call: F) -> Result<Vec<T>, LedgerError>
    where
        F: Fn(&'a SharedLedger) -> Fut,
        Fut: Future<Output = Result<T, LedgerError>> + 'a,
    {
        let got = join_all(self.shards.iter().map(call)).await;
        answered_up(what, got.into_iter().enumerate())
    }
}

/// A shard's lease id as the sharded ledger's (ids past 2^55 would not fit: none is made
/// before a shard has granted that many leases; one that would becomes -1, which no shard
/// knows, so it is fenced rather than routed to another lease).
fn lease_out(shard: usize, id: i64) -> i64 {
    if !(0..=(i64::MAX >> SHARD_BITS)).contains(&id) {
        return -1;
    }
    (id << SHARD_BITS) | shard as i64
}

/// The shard of a sharded lease id, and the shard's own id (a negative id: no shard).
fn lease_in(id: i64) -> (usize, i64) {
    if id < 0 {
        return (usize::MAX, id);
    }
    ((id & (MAX_SHARDS as i64 - 1)) as usize, id >> SHARD_BITS)
}

fn grant_out(shard: usize, g: Grant) -> Grant {
    Grant {
        lease: g.lease.map(|l| Lease {
            id: lease_out(shard, l.id),
            ..l
        }),
        ..g
    }
}

/// The order claims of one commit call.
struct Claims {
    /// The order ids claimed or joined for their own voucher (the call counted on each).
    claimed: HashSet<String>,
    /// Per batch, per row: whether the row goes to its shard.
    allowed: Vec<Vec<bool>>,
}

impl Claims {
    /// Batch `pos` with only the rows that go to its shard.
    fn sent(&self, pos: usize, b: &Batch) -> Batch {
        let mut sent = b.clone();
        sent.rows = b
            .rows
            .iter()
            .zip(&self.allowed[pos])
            .filter(|(_, ok)| **ok)
            .map(|(r, _)| r.clone())
            .collect();
        sent
    }

    /// A shard's answer to batch `pos`: an answer that does not cover every row sent is no
    /// answer (its rows may have been stored: their claims stay).
    fn checked(
        &self,
        pos: usize,
        got: Result<Vec<RowOutcome>, LedgerError>,
    ) -> Result<Vec<RowOutcome>, LedgerError> {
        let sent = self.allowed[pos].iter().filter(|ok| **ok).count();
        match got {
            Ok(rows) if rows.len() != sent => Err(LedgerError::Inconsistent(SHORT_ANSWER)),
            got => got,
        }
    }

    /// Whether rows of batch `pos` were refused for another voucher's claim.
    fn refused_any(&self, pos: usize) -> bool {
        self.allowed[pos].iter().any(|ok| !ok)
    }

    /// Batch `pos`'s answers in row order: its shard's for the rows sent; for the others
    /// `NOT_ELIGIBLE` where the voucher refused every new order then (`blocked`, DESIGN §4's
    /// precedence), else `ALREADY_USED`.
    fn answers(
        &self,
        pos: usize,
        got: Vec<RowOutcome>,
        blocked: Option<Ineligible>,
    ) -> Vec<RowOutcome> {
        let refused = || blocked.map_or(RowOutcome::AlreadyUsed, RowOutcome::NotEligible);
        let mut got = got.into_iter();
        self.allowed[pos]
            .iter()
            .map(|ok| match ok {
                // `checked` made sure the answer covers every row sent.
                true => got.next().unwrap_or(RowOutcome::AlreadyUsed),
                false => refused(),
            })
            .collect()
    }
}

/// The answers of the shards that answered, each failure logged as `what`'s; the first error
/// only when none answered.
fn answered_up<T>(
    what: &str,
    got: impl Iterator<Item = (usize, Result<T, LedgerError>)>,
) -> Result<Vec<T>, LedgerError> {
    let mut answered = Vec::new();
    let mut failed = None;
    for (shard, got) in got {
        match got {
            Ok(t) => answered.push(t),
            Err(e) => {
                tracing::warn!(shard, error = %e, "{what} failed on a shard");
                failed.get_or_insert(e);
            }
        }
    }
    match failed {
        Some(e) if answered.is_empty() => Err(e),
        _ => Ok(answered),
    }
}

/// Concatenates the shards' lists.
fn flat<T>(lists: Vec<Vec<T>>) -> Vec<T> {
    lists.into_iter().flatten().collect()
}

#[async_trait]
impl Ledger for ShardedLedger {
    /// The directory's shard: a node stays ready while one of the others is down, whose
    /// vouchers alone answer `503`.
    async fn ping(&self) -> Result<(), LedgerError> {
        if self.outrun.load(Ordering::Acquire) {
            return Err(LedgerError::Invalid(OUTRUN));
        }
        // With claims nothing commits while the directory's breaker is open.
        let breaker = &self.directory_breaker;
        if self.claims.is_some() && breaker.refuses(breaker.now_ms()) {
            return Err(LedgerError::CircuitOpen);
        }
        self.shards[0].ping().await
    }

    /// Its shard's breaker (a code not placed yet: none refuses it here), and with claims the
    /// directory's breaker, which every commit passes; every code once claims began without this
    /// node.
    fn refuses(&self, code: &str) -> bool {
        let breaker = &self.directory_breaker;
        if self.outrun.load(Ordering::Acquire)
            || (self.claims.is_some() && breaker.refuses(breaker.now_ms()))
        {
            return true;
        }
        let shard = self
            .placed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(code)
            .copied();
        shard.is_some_and(|s| self.shard_down(s))
    }

    fn lost(&self) {
        self.shards.iter().for_each(|s| s.lost());
    }

    fn server(&self) -> Option<(String, u64)> {
        self.shards[0].server().map(|(s, _)| (s, self.failovers()))
    }

    fn failovers(&self) -> u64 {
        self.shards.iter().map(|s| s.failovers()).sum()
    }

    async fn give_back_memory(&self) {
        join_all(self.shards.iter().map(|s| s.give_back_memory())).await;
    }

    async fn create_voucher(&self, voucher: &Voucher, now: Millis) -> Result<(), LedgerError> {
        let s = self.place(&voucher.code, now).await?;
        self.shards[s].create_voucher(voucher, now).await
    }

    async fn voucher(&self, code: &str) -> Result<Option<Voucher>, LedgerError> {
        match self.shard_of(code).await? {
            Some(s) => self.shards[s].voucher(code).await,
            None => Ok(None),
        }
    }

    async fn vouchers(&self, codes: &[String]) -> Result<Vec<Voucher>, LedgerError> {
        self.by_code_shard(codes, None, |s, codes| async move {
            self.shards[s].vouchers(&codes).await
        })
        .await
    }

    async fn voucher_stock(&self, code: &str) -> Result<Option<(Voucher, i64)>, LedgerError> {
        match self.shard_of(code).await? {
            Some(s) => self.shards[s].voucher_stock(code).await,
            None => Ok(None),
        }
    }

    async fn update_voucher(
        &self,
        code: &str,
        patch: &VoucherPatch,
    ) -> Result<(Voucher, Option<Restock>), LedgerError> {
        self.route(code).await?.1.update_voucher(code, patch).await
    }

    async fn grant(
        &self,
        code: &str,
        node: &str,
        want: i64,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Grant, LedgerError> {
        let (s, l) = self.route(code).await?;
        Ok(grant_out(s, l.grant(code, node, want, now, ttl_ms).await?))
    }

    async fn grant_many(
        &self,
        asks: &[GrantAsk],
    ) -> Result<Vec<Result<Grant, LedgerError>>, LedgerError> {
        let (by_shard, unplaced) = self.split(asks, |a| &a.code).await?;
        let mut answers: Vec<Result<Grant, LedgerError>> = (0..asks.len())
            .map(|_| Err(LedgerError::NotFound))
            .collect();
        let by_shard = by_shard
            .into_iter()
            .map(|part| part.into_iter().map(|(p, a)| (p, a.clone())).collect())
            .collect();
        self.gather(
            by_shard,
            &mut answers,
            |s, asks: Vec<GrantAsk>| async move {
                let got = self.shards[s].grant_many(&asks).await?;
                Ok(got
                    .into_iter()
                    .map(|g| g.map(|g| grant_out(s, g)))
                    .collect())
            },
        )
        .await?;
        debug_assert!(unplaced.iter().all(|p| answers[*p].is_err()));
        Ok(answers)
    }

    async fn open(&self, ask: &OpenAsk) -> Result<Opened, LedgerError> {
        let Some(s) = self.shard_of(&ask.grant.code).await? else {
            return Ok(Opened {
                voucher: None,
                grant: None,
            });
        };
        let opened = self.shards[s].open(ask).await?;
        Ok(Opened {
            voucher: opened.voucher,
            grant: opened.grant.map(|g| g.map(|g| grant_out(s, g))),
        })
    }

    async fn renew(
        &self,
        lease_ids: &[i64],
        node: &str,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Vec<i64>, LedgerError> {
        let mut by_shard: Vec<Vec<i64>> = vec![Vec::new(); self.shards.len()];
        for &id in lease_ids {
            let (s, local) = lease_in(id);
            if let Some(ids) = by_shard.get_mut(s) {
                ids.push(local);
            }
        }
        let lists = try_join_all(by_shard.into_iter().enumerate().map(|(s, ids)| async move {
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            let kept = self.shards[s].renew(&ids, node, now, ttl_ms).await?;
            Ok::<_, LedgerError>(kept.into_iter().map(|id| lease_out(s, id)).collect())
        }))
        .await?;
        Ok(flat(lists))
    }

    async fn active_leases(&self, code: &str, node: &str) -> Result<Vec<i64>, LedgerError> {
        let Some(s) = self.shard_of(code).await? else {
            return Ok(Vec::new());
        };
        let ids = self.shards[s].active_leases(code, node).await?;
        Ok(ids.into_iter().map(|id| lease_out(s, id)).collect())
    }

    async fn return_lease(
        &self,
        lease_id: i64,
        now: Millis,
    ) -> Result<Option<Restock>, LedgerError> {
        let (s, local) = lease_in(lease_id);
        match self.shards.get(s) {
            Some(l) => l.return_lease(local, now).await,
            None => Ok(None),
        }
    }

    async fn return_leases(
        &self,
        leases: &[(i64, Millis)],
    ) -> Result<Vec<Option<Restock>>, LedgerError> {
        let mut by_shard: Vec<Vec<(usize, (i64, Millis))>> = vec![Vec::new(); self.shards.len()];
        for (pos, &(id, now)) in leases.iter().enumerate() {
            let (s, local) = lease_in(id);
            if let Some(part) = by_shard.get_mut(s) {
                part.push((pos, (local, now)));
            }
        }
        let mut answers: Vec<Option<Restock>> = vec![None; leases.len()];
        self.gather(
            by_shard,
            &mut answers,
            |s, asks: Vec<(i64, Millis)>| async move { self.shards[s].return_leases(&asks).await },
        )
        .await?;
        Ok(answers)
    }

    async fn return_node_leases(
        &self,
        node: &str,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        Ok(flat(
            self.each_up("returning the node's leases", |l| {
                l.return_node_leases(node, now)
            })
            .await?,
        ))
    }

    /// Numbered by the directory's shard; the other shards record the same holder's beat.
    async fn register_node(
        &self,
        name: &str,
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Incarnation, LedgerError> {
        let me = self.shards[0]
            .register_node(name, now, dead_after_ms)
            .await?;
        // A shard that is down records the holder at its first beat there.
        let beats = join_all(
            self.shards[1..]
                .iter()
                .map(|l| l.heartbeat(&me.holder, now, dead_after_ms)),
        )
        .await;
        for (i, beat) in beats.into_iter().enumerate() {
            if let Err(e) = beat {
                tracing::warn!(shard = i + 1, error = %e, "could not record the node on a shard");
            }
        }
        Ok(me)
    }

    /// Every shard's beat: the directory's clock, and the holders dead on any shard that
    /// answered (a holder is reaped shard by shard, each judging by its own beats). The
    /// directory's shard must answer; another that is down misses this beat alone.
    async fn heartbeat(
        &self,
        holder: &str,
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Beat, LedgerError> {
        // A node without claims reads the claim mode beside its beats (at most a quarter
        // second, on the beats' own connection).
        let (first, others, ()) = tokio::join!(
            self.shards[0].heartbeat(holder, now, dead_after_ms),
            join_all(
                self.shards[1..]
                    .iter()
                    .map(|l| l.heartbeat(holder, now, dead_after_ms))
            ),
            async {
                if self.claims.is_none() {
                    self.check_claim_mode().await;
                }
            }
        );
        let first = first?;
        let mut dead: HashSet<String> = first.dead.into_iter().collect();
        for (i, beat) in others.into_iter().enumerate() {
            match beat {
                Ok(b) => dead.extend(b.dead),
                Err(e) => tracing::warn!(shard = i + 1, error = %e, "heartbeat failed on a shard"),
            }
        }
        let mut dead: Vec<String> = dead.into_iter().collect();
        dead.sort();
        Ok(Beat {
            ledger_ms: first.ledger_ms,
            dead,
        })
    }

    async fn reap_holder(&self, holder: &str, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        Ok(flat(
            self.each_up("reaping a holder", |l| l.reap_holder(holder, now))
                .await?,
        ))
    }

    async fn retire_node(&self, holder: &str) -> Result<(), LedgerError> {
        self.each_up("retiring the node", |l| l.retire_node(holder))
            .await
            .map(|_| ())
    }

    async fn commit_batch(&self, batch: &Batch) -> Result<Vec<RowOutcome>, LedgerError> {
        self.not_outrun()?;
        let (s, l) = self.route(&batch.voucher_code).await?;
        let (lease_shard, local) = lease_in(batch.lease_id);
        if lease_shard != s {
            return Err(LedgerError::Fenced);
        }
        let claims = self.claim(&[batch]).await?;
        let mut sent = claims.sent(0, batch);
        let got = if sent.rows.is_empty() {
            Ok(Vec::new())
        } else {
            sent.lease_id = local;
            claims.checked(0, l.commit_batch(&sent).await)
        };
        if let Err(e) = &got {
            self.outrun_by(e);
        }
        self.settle(&claims, &[batch], std::slice::from_ref(&got))
            .await;
        let got = got?;
        // The shard's answers stand whatever this read finds.
        let blocked = self.blocked(&claims, 0, batch, &got).await.unwrap_or(None);
        Ok(claims.answers(0, got, blocked))
    }

    /// Each shard's batches in one transaction of that shard. A shard whose transaction failed
    /// answers its own batches `CommitFailed`; the outer error only when every shard failed. A
    /// batch that carries an order id an earlier batch carries to another voucher commits in a
    /// later round, once that one is settled (as if they committed one after the other).
    async fn commit_batches(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        let mut first: HashMap<&str, &str> = HashMap::new();
        let (mut now, mut later) = (Vec::new(), Vec::new());
        for (pos, b) in batches.iter().enumerate() {
            let code = b.voucher_code.as_str();
            // From the first clash on, every batch waits: slice order holds.
            let clash = !later.is_empty()
                || b.rows
                    .iter()
                    .any(|r| first.get(r.order_id.as_str()).is_some_and(|c| *c != code));
            if clash {
                later.push(pos);
                continue;
            }
            for r in &b.rows {
                first.entry(r.order_id.as_str()).or_insert(code);
            }
            now.push(pos);
        }
        if later.is_empty() {
            return self.commit_round(batches).await;
        }
        let round: Vec<Batch> = now.iter().map(|&p| batches[p].clone()).collect();
        let rest: Vec<Batch> = later.iter().map(|&p| batches[p].clone()).collect();
        let mut answers: BatchResults = (0..batches.len())
            .map(|_| Err(LedgerError::Inconsistent("no answer for the batch")))
            .collect();
        for (pos, r) in now.into_iter().zip(self.commit_round(&round).await?) {
            answers[pos] = r;
        }
        match self.commit_batches(&rest).await {
            Ok(results) => later
                .into_iter()
                .zip(results)
                .for_each(|(pos, r)| answers[pos] = r),
            Err(e) => {
                let e = Arc::new(e);
                later
                    .into_iter()
                    .for_each(|pos| answers[pos] = Err(LedgerError::CommitFailed(e.clone())));
            }
        }
        Ok(answers)
    }

    async fn find_orders(&self, order_ids: &[String]) -> Result<Vec<Reservation>, LedgerError> {
        Ok(flat(
            self.each_up("finding orders", |l| l.find_orders(order_ids))
                .await?,
        ))
    }

    /// `code`'s shard strictly, the others as they answer.
    async fn find_orders_for(
        &self,
        code: &str,
        order_ids: &[String],
    ) -> Result<Vec<Reservation>, LedgerError> {
        let Some(own) = self.shard_of(code).await? else {
            return self.find_orders(order_ids).await;
        };
        let (mine, others) = tokio::join!(
            self.shards[own].find_orders(order_ids),
            join_all(
                self.shards
                    .iter()
                    .enumerate()
                    .filter(|(s, _)| *s != own)
                    .map(|(_, l)| l.find_orders(order_ids))
            )
        );
        let mut found = mine?;
        for other in others {
            match other {
                Ok(rows) => found.extend(rows),
                Err(e) => tracing::warn!(error = %e, "finding orders failed on a shard"),
            }
        }
        Ok(found)
    }

    async fn won_orders(&self, code: &str) -> Result<Vec<(String, i64)>, LedgerError> {
        match self.shard_of(code).await? {
            Some(s) => self.shards[s].won_orders(code).await,
            None => Ok(Vec::new()),
        }
    }

    async fn customer_usage(
        &self,
        code: &str,
        customers: &[i64],
    ) -> Result<Vec<(i64, i64)>, LedgerError> {
        match self.shard_of(code).await? {
            Some(s) => self.shards[s].customer_usage(code, customers).await,
            None => Ok(Vec::new()),
        }
    }

    async fn confirm(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<Reservation, LedgerError> {
        self.route(code).await?.1.confirm(code, order_id, now).await
    }

    async fn release(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<(Reservation, Option<Restock>), LedgerError> {
        self.route(code).await?.1.release(code, order_id, now).await
    }

    async fn expire_due(&self, now: Millis, limit: i64) -> Result<Vec<Restock>, LedgerError> {
        Ok(flat(
            self.each_up("expiry", |l| l.expire_due(now, limit)).await?,
        ))
    }

    async fn reap_expired(&self, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        Ok(flat(
            self.each_up("reaping expired leases", |l| l.reap_expired(now))
                .await?,
        ))
    }

    async fn counters_each(
        &self,
        codes: &[String],
    ) -> Result<(Vec<Option<Counters>>, Vec<usize>), LedgerError> {
        let (by_shard, _) = self.split(codes, |c| c).await?;
        let parts = join_all(
            by_shard
                .into_iter()
                .enumerate()
                .filter(|(_, part)| !part.is_empty())
                .map(|(s, part)| async move {
                    let (positions, codes): (Vec<usize>, Vec<String>) =
                        part.into_iter().map(|(p, c)| (p, c.clone())).unzip();
                    let got = self.shards[s].counters_many(&codes).await;
                    (s, positions, got)
                }),
        )
        .await;
        let mut answers: Vec<Option<Counters>> = vec![None; codes.len()];
        let (mut unread, mut failed, mut answered) = (Vec::new(), None, false);
        for (shard, positions, got) in parts {
            match got {
                Ok(got) if got.len() == positions.len() => {
                    answered = true;
                    for (pos, c) in positions.into_iter().zip(got) {
                        answers[pos] = c;
                    }
                }
                // Only a shard that is down leaves its codes for later; any other error (the
                // database answering, a short answer) fails the recount as a whole.
                Err(
                    e @ (LedgerError::Unreachable { .. }
                    | LedgerError::Deadline
                    | LedgerError::CircuitOpen
                    | LedgerError::WorkerGone),
                ) => {
                    tracing::warn!(shard, error = %e, "a recount found its shard down");
                    unread.extend(positions);
                    failed.get_or_insert(e);
                }
                Err(e) => return Err(e),
                Ok(_) => return Err(LedgerError::Inconsistent(SHORT_ANSWER)),
            }
        }
        match failed {
            Some(e) if !answered => Err(e),
            _ => Ok((answers, unread)),
        }
    }

    async fn counters_many(&self, codes: &[String]) -> Result<Vec<Option<Counters>>, LedgerError> {
        let (by_shard, _) = self.split(codes, |c| c).await?;
        let mut answers: Vec<Option<Counters>> = vec![None; codes.len()];
        let by_shard = by_shard
            .into_iter()
            .map(|part| part.into_iter().map(|(p, c)| (p, c.clone())).collect())
            .collect();
        self.gather(by_shard, &mut answers, |s, codes: Vec<String>| async move {
            self.shards[s].counters_many(&codes).await
        })
        .await?;
        Ok(answers)
    }

    /// Those of the shards that answer: a shard that is down leaves its vouchers out (their
    /// series keep their last values) instead of stopping every voucher's numbers.
    async fn live_units(
        &self,
        now: Millis,
        ending_after: Millis,
        codes: &[String],
    ) -> Result<Vec<LiveUnits>, LedgerError> {
        self.by_code_shard(codes, Some("live numbers"), |s, codes| async move {
            self.shards[s].live_units(now, ending_after, &codes).await
        })
        .await
    }

    async fn starting_between(&self, from: Millis, to: Millis) -> Result<Vec<String>, LedgerError> {
        // The shards that answer: one that is down does not stop every shard's pre-heat.
        let mut codes = flat(
            self.each_up("the pre-heat's read", |l| l.starting_between(from, to))
                .await?,
        );
        codes.sort();
        Ok(codes)
    }

    /// The directory's shard holds the switches.
    async fn switches(&self) -> Result<Switches, LedgerError> {
        self.shards[0].switches().await
    }

    async fn set_switches(
        &self,
        patch: &SwitchesPatch,
        now: Millis,
    ) -> Result<Switches, LedgerError> {
        self.shards[0].set_switches(patch, now).await
    }

    /// Each shard's page from `after`, merged in code order and cut at `limit`: the next page
    /// starts after the last code of this one, so none is skipped. The whole catalogue (no
    /// window) comes from the directory alone, whatever shard is down.
    async fn voucher_codes(
        &self,
        ending_after: Millis,
        after: &str,
        limit: i64,
    ) -> Result<Vec<String>, LedgerError> {
        if ending_after == Millis::MIN {
            return self
                .on_directory(self.directory.placed_codes(after, limit))
                .await;
        }
        // The audit's page: the shards that answer (one that is down is audited at a later
        // pass over the catalogue).
        let mut codes = flat(
            self.each_up("the audit's page of the catalogue", |l| {
                l.voucher_codes(ending_after, after, limit)
            })
            .await?,
        );
        codes.sort();
        codes.truncate(usize::try_from(limit).unwrap_or(0));
        Ok(codes)
    }

    /// From the directory alone, whatever shard is down: the codes placed since (a code whose
    /// create then failed is known, and found to have no voucher when asked for).
    async fn codes_created_since(&self, since: Millis) -> Result<Vec<String>, LedgerError> {
        let mut codes = self
            .on_directory(self.directory.placed_since(since))
            .await?;
        codes.sort();
        Ok(codes)
    }

    /// Those of the shards that answer (for the live numbers, which go on without a shard
    /// that is down).
    async fn watched_codes(&self) -> Result<Vec<String>, LedgerError> {
        let mut codes = flat(
            self.each_up("reading the watched vouchers", |l| l.watched_codes())
                .await?,
        );
        codes.sort();
        Ok(codes)
    }

    async fn set_watched(&self, code: &str, watched: bool) -> Result<(), LedgerError> {
        self.route(code).await?.1.set_watched(code, watched).await
    }

    /// The merged feed, after copying what the shards added since the last merge.
    async fn events(&self, after: i64, limit: i64) -> Result<Vec<FeedEvent>, LedgerError> {
        self.on_directory(self.directory.merge_feeds(
            self.shards.len(),
            MERGE_PAGE,
            |s, after, page| self.shards[s].events(after, page),
        ))
        .await?;
        self.on_directory(self.directory.merged_events(after, limit))
            .await
    }

    async fn feed_origin(&self) -> Result<String, LedgerError> {
        Ok(self.origin.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_id_names_its_shard_and_the_shards_own_id() {
        for shard in [0, 1, 7, MAX_SHARDS - 1] {
            for id in [1, 2, 1 << 40, (i64::MAX >> SHARD_BITS)] {
                assert_eq!(lease_in(lease_out(shard, id)), (shard, id));
            }
        }
        assert_ne!(lease_out(0, 1), lease_out(1, 1));
        assert_eq!(lease_out(3, (i64::MAX >> SHARD_BITS) + 1), -1, "too large");
        assert_eq!(lease_in(-1).0, usize::MAX, "no shard");
    }

    #[test]
    fn a_refusal_before_the_transaction_stored_nothing_however_wrapped() {
        let wrapped = |e| LedgerError::CommitFailed(Arc::new(e));
        assert!(stored_nothing(&LedgerError::CircuitOpen));
        assert!(stored_nothing(&wrapped(LedgerError::CircuitOpen)));
        assert!(stored_nothing(&wrapped(wrapped(LedgerError::QueueFull))));
        assert!(!stored_nothing(&wrapped(LedgerError::Deadline)));
        assert!(!stored_nothing(&wrapped(wrapped(LedgerError::Deadline))));
        assert!(!stored_nothing(&LedgerError::Inconsistent(SHORT_ANSWER)));
        let coded = |c: &str| LedgerError::Database {
            code: Some(c.to_string()),
            source: "refused".into(),
        };
        assert!(stored_nothing(&wrapped(coded("VC001"))));
        assert!(stored_nothing(&coded("40P01")));
        assert!(!stored_nothing(&wrapped(coded("XX000"))), "unknown: kept");
    }

    async fn admin_pool(url: &str) -> sqlx::PgPool {
        sqlx::PgPool::connect(url).await.unwrap()
    }

    fn pairs(spec: &[(&str, &str)]) -> Vec<(String, String)> {
        spec.iter()
            .map(|(o, c)| (o.to_string(), c.to_string()))
            .collect()
    }

    /// One merged round where an earlier call carries an order to V and a later one retries it
    /// on W, which holds it: the retry joins W's claim (it is not refused for V's ask), and an
    /// order new to both goes to the first call's voucher, counted once per call.
    #[tokio::test]
    #[cfg_attr(
        no_test_pg,
        ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
    )]
    async fn a_merged_round_gives_a_held_order_to_its_holder() {
        let base = std::env::var("TEST_DATABASE_URL").expect("TEST_DATABASE_URL");
        let schema = format!("t_round_{}", crate::startup::random_hex(6));
        let admin = sqlx::PgPool::connect(&base).await.unwrap();
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&admin)
            .await
            .unwrap();
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-c%20search_path%3D{schema}");
        let store = Arc::new(PostgresLedger::connect(&url, 2, 0, 1000).await.unwrap());
        let round = claims_merged(
            store.clone(),
            Arc::new(Breaker::new(0, 0)),
            Duration::from_secs(5),
        );
        let held = round(vec![pairs(&[("o", "W"), ("h", "Z")])]).await.unwrap();
        assert_eq!(
            held[0].as_ref().unwrap(),
            &HashSet::from(["o".to_string(), "h".to_string()])
        );
        let got = round(vec![
            pairs(&[("o", "V"), ("n", "V"), ("h", "V")]),
            pairs(&[("o", "W"), ("n", "W"), ("h", "W")]),
            pairs(&[("n", "V"), ("h", "Y")]),
            pairs(&[("h", "Z")]),
        ])
        .await
        .unwrap();
        let got: Vec<HashSet<String>> = got.into_iter().map(|g| g.unwrap()).collect();
        assert_eq!(got[0], HashSet::from(["n".to_string()]));
        assert_eq!(got[1], HashSet::from(["o".to_string()]), "the retry joins");
        assert_eq!(got[2], HashSet::from(["n".to_string()]));
        assert_eq!(
            got[3],
            HashSet::from(["h".to_string()]),
            "its fourth choice"
        );
        let claims: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT order_id, code, pending FROM order_claims ORDER BY order_id")
                .fetch_all(&admin_pool(&url).await)
                .await
                .unwrap();
        assert_eq!(
            claims,
            [
                ("h".into(), "Z".into(), 2),
                ("n".into(), "V".into(), 2),
                ("o".into(), "W".into(), 2)
            ]
        );
    }
}
