//! The vouchers whose books this node changed and that wait for a recount ([`Changed`]), the
//! one budget every recount of the node's upkeep shares ([`RecountPace`]), how often one
//! voucher is recounted at its sell-outs ([`SellOutRecounts`]), and when the memory a flood
//! left goes back ([`GiveBackGate`]).
//!
//! The reconciler takes up to its share of the changed vouchers each run; a flood of first
//! reserves on a long tail leaves far more (a backlog), which the live numbers work off a page
//! a second within what the budget leaves. Once the backlog is recounted (the reconciler has
//! caught up and no recount is in flight), [`Changed::backlog_done`] says so once: the node
//! then gives memory back.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The changed vouchers, oldest first, with what is being recounted now.
#[derive(Default)]
pub(crate) struct Changed {
    /// The codes and the state of their recounts, under one lock: a take, its bookkeeping and
    /// [`Changed::backlog_done`] never interleave, whatever runs the jobs.
    queue: Mutex<Queue>,
}

/// The set in first-marked order. A code marked again while it waits keeps its place, so a
/// voucher changed again and again is not passed over for ever; taking from the front costs
/// what is taken, not what waits.
#[derive(Default)]
pub(crate) struct Queue {
    /// The codes, oldest first.
    order: VecDeque<Arc<str>>,
    /// The same codes, to find one in constant time (each shared with `order`).
    members: HashSet<Arc<str>>,
    /// Codes taken and not recounted yet (a [`Taken`] not dropped): the backlog is not done
    /// while a recount of some of it is still reading.
    in_flight: usize,
    /// Some of a backlog was taken since [`Changed::backlog_done`] last said so.
    backlog_seen: bool,
    /// A take of everything waiting (a reconciler run that found no more than its share) was
    /// recounted, and no backlog page was taken after it: the node has caught up.
    caught_up: bool,
    /// Backlog pages taken so far: a take of everything that started before the last page
    /// does not count as catching up with it.
    pages: u64,
}

impl Queue {
    /// `code` changed: it waits for a recount (once, however often it is marked).
    pub(crate) fn mark(&mut self, code: &str) {
        if !self.members.contains(code) {
            let code: Arc<str> = Arc::from(code);
            self.members.insert(code.clone());
            self.order.push_back(code);
        }
    }

    fn len(&self) -> usize {
        self.order.len()
    }

    /// Up to `most` codes from the front, if more than `beyond` wait; the room goes back once
    /// the queue is mostly empty.
    fn take(&mut self, most: usize, beyond: usize) -> Vec<String> {
        if self.order.len() <= beyond {
            return Vec::new();
        }
        let n = most.min(self.order.len());
        let taken: Vec<String> = self
            .order
            .drain(..n)
            .map(|code| {
                self.members.remove(&code);
                code.to_string()
            })
            .collect();
        if crate::memory::mostly_empty(self.order.capacity(), self.order.len()) {
            self.order.shrink_to_fit();
        }
        if crate::memory::mostly_empty(self.members.capacity(), self.members.len()) {
            self.members.shrink_to_fit();
        }
        taken
    }
}

/// Codes taken for a recount; dropping it (the recount done, or failed and the codes marked
/// again) ends their time in flight.
pub(crate) struct Taken<'a> {
    /// The codes to recount.
    codes: Vec<String>,
    /// Where they were taken from, told when the recount is over.
    from: &'a Changed,
    /// Everything that waited was taken: once recounted, the node has caught up (unless a
    /// backlog page was taken meanwhile).
    all: bool,
    /// [`Queue::pages`] when this was taken.
    pages: u64,
    /// The recount failed: its codes wait again, so the node has not caught up.
    failed: bool,
}

impl std::ops::Deref for Taken<'_> {
    type Target = [String];
    fn deref(&self) -> &[String] {
        &self.codes
    }
}

impl Taken<'_> {
    /// The recount failed and the codes were marked again: they still wait, so this take
    /// does not count as catching up.
    pub(crate) fn failed(&mut self) {
        self.all = false;
        self.failed = true;
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let mut queue = self.from.lock();
        if self.failed {
            queue.caught_up = false;
        } else if self.all && queue.pages == self.pages {
            queue.caught_up = true;
        }
        queue.in_flight -= self.codes.len();
    }
}

impl Changed {
    /// Marks codes under one lock (the reconciler's sweep of its actors' flags).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `code` changed: the reconciler recounts it at its next run.
    pub(crate) fn mark(&self, code: &str) {
        self.lock().mark(code);
    }

    /// The reconciler's share: up to `most`, the oldest first.
    pub(crate) fn take(&self, most: usize) -> Taken<'_> {
        let mut queue = self.lock();
        let all = queue.len() <= most;
        let codes = queue.take(most, 0);
        self.in_flight(queue, codes, all)
    }

    /// A page of a backlog: up to `most` of the oldest codes if more than `share` (what the
    /// reconciler's next run takes) wait.
    pub(crate) fn take_backlog(&self, most: usize, share: usize) -> Taken<'_> {
        let mut queue = self.lock();
        let codes = queue.take(most, share);
        if !codes.is_empty() {
            queue.backlog_seen = true;
            queue.caught_up = false;
            queue.pages += 1;
        }
        self.in_flight(queue, codes, false)
    }

    fn in_flight(
        &self,
        mut queue: MutexGuard<'_, Queue>,
        codes: Vec<String>,
        all: bool,
    ) -> Taken<'_> {
        queue.in_flight += codes.len();
        Taken {
            pages: queue.pages,
            codes,
            from: self,
            all,
            failed: false,
        }
    }

    /// Whether a backlog was being worked off and is recounted now: every page of it read, and
    /// a reconciler run that took all that waited finished since (under a steady trickle of
    /// confirms the set is never empty, but it stays within the reconciler's share). Says so
    /// once per backlog.
    pub(crate) fn backlog_done(&self) -> bool {
        let mut queue = self.lock();
        let done = queue.backlog_seen && queue.caught_up && queue.in_flight == 0;
        if done {
            queue.backlog_seen = false;
        }
        done
    }
}

/// How far ahead the budget is ever booked: a long wave of sell-outs, or a recount that waited
/// out the ledger's deadline, holds the backlog back for this long at most.
const MAX_DEBT: Duration = Duration::from_secs(60);

/// The budget the node's recounts share: each recount (the reconciler's, one after a sell-out,
/// a backlog page) is charged [`RECOUNT_IDLE_FACTOR`](super::RECOUNT_IDLE_FACTOR) times what
/// it took, on one timeline, and a backlog page waits until the timeline is paid off. The
/// reconciler's and the sell-outs' recounts are not delayed (they keep their own pace, and a
/// sell-out's is due now), so together with the backlog they stay within about 5 % of a core:
/// a busy reconciler leaves the backlog nothing.
#[derive(Default)]
pub(crate) struct RecountPace {
    /// Until when the recounts so far are paid for.
    paid_until: Mutex<Option<Instant>>,
}

impl RecountPace {
    /// Whether the recounts so far are paid for at `now`.
    pub(crate) fn ready(&self, now: Instant) -> bool {
        self.paid_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none_or(|until| now >= until)
    }

    /// A recount that ended at `now` took `took`.
    pub(crate) fn spent(&self, now: Instant, took: Duration) {
        let mut until = self.paid_until.lock().unwrap_or_else(|e| e.into_inner());
        let from = until.map_or(now, |u| u.max(now));
        *until = Some((from + took * super::RECOUNT_IDLE_FACTOR).min(now + MAX_DEBT));
    }
}

/// How often one voucher's books are recounted when it sells out at most: a voucher sold out
/// again sooner (a client cycling releases and reserves on it) waits for the reconciler's
/// recount of the changed vouchers instead, so a handful of large vouchers cannot keep the
/// sell-outs' recounts (each a read of every row of the voucher) busy.
pub(crate) const SELL_OUT_RECOUNT_EVERY: Duration = Duration::from_secs(30);

/// When each voucher last had its sell-out recount (only those within
/// [`SELL_OUT_RECOUNT_EVERY`]: the vouchers that sold out here lately).
#[derive(Default)]
pub(crate) struct SellOutRecounts {
    last: Mutex<std::collections::HashMap<String, Instant>>,
}

impl SellOutRecounts {
    /// Splits `codes` (vouchers that sold out here) into those to recount now (each marked as
    /// recounted at `now`) and those recounted at a sell-out less than
    /// [`SELL_OUT_RECOUNT_EVERY`] ago; forgets the marks older than that.
    pub(crate) fn due(&self, codes: Vec<String>, now: Instant) -> (Vec<String>, Vec<String>) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.retain(|_, at| now.saturating_duration_since(*at) < SELL_OUT_RECOUNT_EVERY);
        let (mut now_codes, mut later) = (Vec::new(), Vec::new());
        for code in codes {
            if last.contains_key(&code) {
                later.push(code);
            } else {
                last.insert(code.clone(), now);
                now_codes.push(code);
            }
        }
        (now_codes, later)
    }
}

/// Requests per second at or below which the node counts as quiet, so that memory may go back:
/// the reserves answered on this node for its vouchers with an actor (from memory included),
/// and the confirms and releases asked of it. A give-back collects on every arbiter at once (a
/// few milliseconds each) and takes the writer for one statement, which a trickle of requests
/// can wait for but a sale's burst should not. Counted per run of the live numbers, scaled to
/// its interval (`jobs.live_numbers_interval_ms`): 100 a run at the default second.
pub(crate) const QUIET_PER_SECOND: u64 = 100;
/// How long a due give-back waits for a quiet node at most (five minutes; in runs of the live
/// numbers, scaled to their interval): a client asking a hundred times a second, even at a
/// sold-out code, would otherwise hold it off for ever.
pub(crate) const GIVE_BACK_MAX_WAIT_MS: u64 = 300_000;
/// The default interval of the live numbers, at which [`GiveBackGate::default`] counts.
const DEFAULT_RUN_MS: u64 = 1_000;

/// Whether the node gives memory back at this run of the live numbers: once one is due (a
/// flood's actors stopped, or its backlog was recounted), at the first quiet run, and at most
/// once per run. Only the live numbers ask, one run after the other.
pub(crate) struct GiveBackGate {
    /// The runs a due give-back has waited so far, plus one (0: none is due).
    due: AtomicU32,
    /// Requests in a run at or below which the node is quiet ([`QUIET_PER_SECOND`] scaled to
    /// the run's interval), and the runs a due give-back waits at most.
    quiet_per_run: u64,
    max_wait_runs: u32,
    /// Confirms and releases asked of this node since the last run: each takes the ledger's
    /// writer like a reserve's commit, but no actor counts it.
    writes: AtomicU64,
    /// Give-backs so far (tests and diagnostics).
    runs: AtomicU64,
    /// The last give-back let go was forced (the node was not quiet after the longest wait):
    /// it leaves the ledger's caches alone, which the busy node is using.
    forced: std::sync::atomic::AtomicBool,
    /// A sale starts soon (the pre-heat found one): no give-back before this time, so that the
    /// caches a give-back shrinks are warm when the sale's first second comes.
    held_until: std::sync::atomic::AtomicI64,
    /// How long a pre-heat's sighting of a coming sale holds give-backs: until its next run,
    /// and the sale's first seconds after it ([`HOLD_PAST_START_MS`]).
    hold_ms: i64,
    /// Since when give-backs are held without a break (0: not held): a forced give-back is
    /// let go during a hold only once it lasted the longest wait.
    held_since: std::sync::atomic::AtomicI64,
}

/// How long a give-back stays held after the last pre-heat run that saw a sale coming (so
/// past its start by this much at most): the sale's first seconds.
pub(crate) const HOLD_PAST_START_MS: i64 = 10_000;

impl Default for GiveBackGate {
    fn default() -> Self {
        Self::for_runs_every(DEFAULT_RUN_MS)
    }
}

impl GiveBackGate {
    /// The gate of a node whose live numbers run every `run_ms`.
    pub(crate) fn for_runs_every(run_ms: u64) -> Self {
        let run_ms = run_ms.max(1);
        Self {
            due: AtomicU32::new(0),
            quiet_per_run: (QUIET_PER_SECOND.saturating_mul(run_ms) / 1000).max(1),
            max_wait_runs: u32::try_from(GIVE_BACK_MAX_WAIT_MS / run_ms)
                .unwrap_or(u32::MAX)
                .max(1),
            writes: AtomicU64::new(0),
            runs: AtomicU64::new(0),
            forced: std::sync::atomic::AtomicBool::new(false),
            held_until: std::sync::atomic::AtomicI64::new(0),
            hold_ms: DEFAULT_RUN_MS as i64 + HOLD_PAST_START_MS,
            held_since: std::sync::atomic::AtomicI64::new(0),
        }
    }

    /// The gate of a node whose pre-heat runs every `preheat_ms`.
    pub(crate) fn holding_past_preheat(mut self, preheat_ms: u64) -> Self {
        self.hold_ms = i64::try_from(preheat_ms)
            .unwrap_or(i64::MAX / 4)
            .min(i64::MAX / 4)
            + HOLD_PAST_START_MS;
        self
    }

    /// The pre-heat found a sale coming at `now`: no give-back until its next run, and
    /// [`HOLD_PAST_START_MS`] after (a sale keeps being found until it starts, so the hold
    /// ends that long after the start).
    pub(crate) fn hold_for_sale(&self, now: i64) {
        self.held_until
            .fetch_max(now.saturating_add(self.hold_ms), Ordering::Relaxed);
    }

    /// Whether a give-back is held at `now` (a sale starts soon, or just started).
    pub(crate) fn held(&self, now: i64) -> bool {
        now < self.held_until.load(Ordering::Relaxed)
    }

    /// Memory should go back at the next quiet run.
    pub(crate) fn make_due(&self) {
        self.due.fetch_max(1, Ordering::Relaxed);
    }

    /// A confirm or a release was asked of this node.
    pub(crate) fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    /// Once per run, with the reserves answered since the last: whether to give back now.
    pub(crate) fn now(&self, reserves: u64) -> bool {
        let requests = reserves.saturating_add(self.writes.swap(0, Ordering::Relaxed));
        let due = self.due.load(Ordering::Relaxed);
        if due == 0 {
            return false;
        }
        if requests <= self.quiet_per_run || due > self.max_wait_runs {
            self.forced
                .store(requests > self.quiet_per_run, Ordering::Relaxed);
            self.due.store(0, Ordering::Relaxed);
            self.runs.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            self.due.store(due + 1, Ordering::Relaxed);
            false
        }
    }

    /// [`GiveBackGate::now`] at `now_ms`: while a give-back is held for a sale the node counts
    /// as busy (so the longest wait still ends it, forced, if sales keep starting).
    pub(crate) fn at_run(&self, reserves: u64, now_ms: i64) -> bool {
        if !self.held(now_ms) {
            self.held_since.store(0, Ordering::Relaxed);
            return self.now(reserves);
        }
        let since = match self.held_since.load(Ordering::Relaxed) {
            0 => {
                self.held_since.store(now_ms.max(1), Ordering::Relaxed);
                now_ms
            }
            s => s,
        };
        if now_ms.saturating_sub(since) >= GIVE_BACK_MAX_WAIT_MS as i64 {
            // Held for the whole longest wait (sales that keep coming): forced now.
            self.now(u64::MAX)
        } else {
            // Busy for the wait, but not let go in the middle of a hold.
            let due = self.due.load(Ordering::Relaxed);
            if due > 0 {
                self.due.store(due.saturating_add(1), Ordering::Relaxed);
            }
            self.writes.swap(0, Ordering::Relaxed);
            false
        }
    }

    /// Whether the give-back [`GiveBackGate::now`] last let go was forced on a busy node.
    pub(crate) fn forced(&self) -> bool {
        self.forced.load(Ordering::Relaxed)
    }

    /// Whether a give-back waits for a quiet run.
    pub(crate) fn is_due(&self) -> bool {
        self.due.load(Ordering::Relaxed) > 0
    }

    /// Give-backs so far.
    pub(crate) fn runs(&self) -> u64 {
        self.runs.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marked(codes: &[&str]) -> Changed {
        let c = Changed::default();
        for code in codes {
            c.mark(code);
        }
        c
    }

    /// `V0`, `V1`, … marked in that order, and their codes.
    fn numbered(n: usize) -> (Vec<String>, Changed) {
        let codes: Vec<String> = (0..n).map(|i| format!("V{i}")).collect();
        let c = marked(&codes.iter().map(String::as_str).collect::<Vec<_>>());
        (codes, c)
    }

    fn taken(t: Taken<'_>) -> Vec<String> {
        t.to_vec()
    }

    /// Quiet is a rate: a node whose live numbers run every 200 ms is quiet at 20 requests a
    /// run, one that runs every 5 s at 500; the longest wait is five minutes either way.
    #[test]
    fn quiet_is_counted_per_second_whatever_the_interval() {
        for (run_ms, quiet, runs) in [(200, 20, 1500), (5_000, 500, 60)] {
            let g = GiveBackGate::for_runs_every(run_ms);
            g.make_due();
            assert!(!g.now(quiet + 1), "{run_ms}: busy");
            assert!(g.now(quiet), "{run_ms}: quiet");
            g.make_due();
            for _ in 0..runs {
                assert!(!g.now(u64::MAX), "{run_ms}: still waiting");
            }
            assert!(g.now(u64::MAX), "{run_ms}: five minutes waited");
            assert!(g.forced(), "{run_ms}: on a busy node");
            g.make_due();
            assert!(g.now(0) && !g.forced(), "{run_ms}: quiet, not forced");
        }
    }

    #[test]
    fn a_give_back_is_held_from_a_sale_found_soon_to_its_first_seconds() {
        // The pre-heat runs every 5 s: a sighting holds until the next run and 10 s more.
        let gate = GiveBackGate::default().holding_past_preheat(5_000);
        let hold = 5_000 + HOLD_PAST_START_MS;
        assert!(!gate.held(0));
        gate.hold_for_sale(30_000);
        assert!(gate.held(29_999));
        assert!(gate.held(30_000 + hold - 1));
        assert!(!gate.held(30_000 + hold));
        // An earlier sighting does not shorten the hold.
        gate.hold_for_sale(1_000);
        assert!(gate.held(30_000));
        // While held, a due give-back waits even on a quiet node; it goes once the hold ends.
        gate.make_due();
        assert!(!gate.at_run(0, 31_000));
        assert!(gate.at_run(0, 30_000 + hold), "quiet once the hold is over");
        // Not forced in the middle of a hold however long it waited; forced once a hold has
        // lasted the whole longest wait (sales that keep coming).
        gate.make_due();
        let wait = GIVE_BACK_MAX_WAIT_MS as i64;
        for t in (100_000..100_000 + wait).step_by(1_000) {
            gate.hold_for_sale(t);
            assert!(!gate.at_run(u64::MAX, t), "{t}");
        }
        gate.hold_for_sale(100_000 + wait);
        assert!(gate.at_run(0, 100_000 + wait) && gate.forced());
    }

    #[test]
    fn a_voucher_is_recounted_at_its_sell_outs_once_per_period_at_most() {
        let paced = SellOutRecounts::default();
        let t0 = Instant::now();
        let codes = |c: &[&str]| c.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            paced.due(codes(&["A", "B"]), t0),
            (codes(&["A", "B"]), codes(&[]))
        );
        // Sold out again within the period: later (the reconciler's changed vouchers).
        let soon = t0 + SELL_OUT_RECOUNT_EVERY / 2;
        assert_eq!(
            paced.due(codes(&["A", "C"]), soon),
            (codes(&["C"]), codes(&["A"]))
        );
        // Once the period has passed, again now; C's own period still runs.
        let later = t0 + SELL_OUT_RECOUNT_EVERY;
        assert_eq!(
            paced.due(codes(&["A", "C"]), later),
            (codes(&["A"]), codes(&["C"]))
        );
        // Marks older than the period are forgotten: the map holds recent sell-outs only.
        paced.due(Vec::new(), later + SELL_OUT_RECOUNT_EVERY);
        assert!(paced.last.lock().unwrap().is_empty());
    }

    #[test]
    fn changed_vouchers_are_taken_oldest_first_and_a_remark_keeps_its_place() {
        let c = marked(&["A", "B", "C", "A", "D", "B", "E"]);
        assert_eq!(taken(c.take(2)), ["A", "B"]);
        // Marked again after the take: it goes to the back of the line.
        c.mark("A");
        assert_eq!(taken(c.take(2)), ["C", "D"]);
        assert_eq!(taken(c.take(5)), ["E", "A"]);
        assert!(taken(c.take(5)).is_empty());
    }

    #[test]
    fn a_backlog_is_taken_only_beyond_the_reconcilers_share() {
        let (codes, c) = numbered(10);
        assert!(
            taken(c.take_backlog(3, 10)).is_empty(),
            "nothing beyond the share"
        );
        assert_eq!(taken(c.take_backlog(3, 6)), ["V0", "V1", "V2"]);
        assert_eq!(c.lock().len(), 7);
        // The reconciler takes the rest, oldest first.
        assert_eq!(taken(c.take(100)), codes[3..].to_vec());
    }

    #[test]
    fn a_drained_queue_gives_its_room_back() {
        let (_, c) = numbered(20_000);
        let room = c.lock().order.capacity();
        let t = taken(c.take(19_000));
        assert_eq!(t.len(), 19_000);
        assert_eq!(t[0], "V0");
        let q = c.lock();
        assert!(
            q.order.capacity() < room / 4,
            "{} of {room}",
            q.order.capacity()
        );
        assert!(q.members.capacity() < room / 4, "{}", q.members.capacity());
    }

    #[test]
    fn a_backlog_is_done_once_its_last_pages_are_read_and_the_reconciler_caught_up() {
        let (_, c) = numbered(10);
        assert!(!c.backlog_done(), "no backlog was seen");
        let page = c.take_backlog(6, 3);
        assert_eq!(page.len(), 6);
        assert!(!c.backlog_done(), "4 still wait");
        // The reconciler takes what is left while the page is still being read.
        let rest = c.take(3 + 1);
        drop(rest);
        assert!(
            !c.backlog_done(),
            "the backlog's last page is still being read"
        );
        drop(page);
        assert!(c.backlog_done());
        assert!(!c.backlog_done(), "said once");
    }

    #[test]
    fn a_failed_backlog_page_keeps_the_backlog_from_being_done() {
        let (_, c) = numbered(10);
        let mut page = c.take_backlog(6, 3);
        // The reconciler takes what is left and finishes while the page is being read.
        drop(c.take(3 + 1));
        // The page's recount fails: its codes wait again.
        page.iter().for_each(|code| c.mark(code));
        page.failed();
        drop(page);
        assert!(!c.backlog_done(), "six codes still wait");
        drop(c.take(100));
        assert!(c.backlog_done());
    }

    #[test]
    fn a_steady_trickle_does_not_keep_a_backlog_from_being_done() {
        let (_, c) = numbered(10);
        drop(c.take_backlog(8, 2));
        c.mark("TRICKLE");
        assert!(!c.backlog_done(), "the reconciler has not caught up");
        // A run that took less than all that waited has not caught up.
        c.mark("MORE");
        drop(c.take(1));
        assert!(!c.backlog_done());
        drop(c.take(10));
        // A confirm marks another voucher at once: still done.
        c.mark("NEXT");
        assert!(c.backlog_done());
    }

    #[test]
    fn a_take_of_everything_older_than_the_last_backlog_page_does_not_catch_up() {
        let c = marked(&["A", "B"]);
        let all = c.take(10);
        // More than the share is marked while that run reads; a page of it is taken.
        for code in ["C", "D", "E", "F"] {
            c.mark(code);
        }
        let page = c.take_backlog(2, 1);
        drop(all);
        drop(page);
        assert!(!c.backlog_done(), "E and F still wait");
        drop(c.take(10));
        assert!(c.backlog_done());
    }

    #[test]
    fn a_failed_recount_does_not_catch_up() {
        let c = marked(&["A", "B", "C", "D"]);
        drop(c.take_backlog(2, 1));
        let mut rest = c.take(10);
        rest.failed();
        rest.iter().for_each(|code| c.mark(code));
        drop(rest);
        assert!(!c.backlog_done(), "C and D wait again");
        drop(c.take(10));
        assert!(c.backlog_done());
    }

    #[test]
    fn recounts_share_one_budget() {
        let pace = RecountPace::default();
        let t0 = Instant::now();
        assert!(pace.ready(t0));
        let ms = Duration::from_millis;
        pace.spent(t0, ms(10));
        let factor = super::super::RECOUNT_IDLE_FACTOR;
        assert!(!pace.ready(t0 + ms(10) * factor - ms(1)));
        // A second recount before the first is paid for adds its own rest after it.
        pace.spent(t0 + ms(5), ms(10));
        assert!(!pace.ready(t0 + ms(20) * factor - ms(1)));
        assert!(pace.ready(t0 + ms(20) * factor));
        // However much is charged, the budget is booked a minute ahead at most.
        pace.spent(t0, Duration::from_secs(3600));
        assert!(!pace.ready(t0 + Duration::from_secs(59)));
        assert!(pace.ready(t0 + MAX_DEBT));
    }

    #[test]
    fn a_due_give_back_waits_for_a_quiet_run_once() {
        let g = GiveBackGate::default();
        assert!(!g.now(0), "none is due");
        g.make_due();
        g.make_due();
        assert!(!g.now(QUIET_PER_SECOND + 1), "busy with reserves");
        for _ in 0..=QUIET_PER_SECOND {
            g.wrote();
        }
        assert!(!g.now(0), "busy with confirms and releases");
        assert!(g.now(QUIET_PER_SECOND), "quiet");
        assert!(!g.now(0), "once");
        assert_eq!(g.runs(), 1);
    }

    #[test]
    fn writes_before_a_give_back_is_due_do_not_count_later() {
        let g = GiveBackGate::default();
        for _ in 0..1_000 {
            g.wrote();
        }
        assert!(!g.now(0));
        g.make_due();
        assert!(g.now(0), "the writes were counted in the run before");
    }

    #[test]
    fn a_node_that_is_never_quiet_gives_back_after_the_longest_wait() {
        let g = GiveBackGate::default();
        g.make_due();
        for run in 1..=(GIVE_BACK_MAX_WAIT_MS / DEFAULT_RUN_MS) as u32 {
            assert!(!g.now(u64::MAX), "run {run}");
        }
        assert!(g.now(u64::MAX));
        assert!(!g.now(u64::MAX), "and is done");
    }
}
