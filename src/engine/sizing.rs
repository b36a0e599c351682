//! Lease sizing: how many units an actor asks for, and when it asks for the next block. Pure
//! functions of the recent reserve rate, what is waiting and what the ledger last said was free;
//! time comes in as arguments, so the tests move it by hand.

use crate::clock::Millis;
use crate::config::EngineSettings;

/// The knobs of [`block_size`] and [`low_water`], taken from the engine settings.
#[derive(Debug, Clone, Copy)]
pub struct SizingParams {
    pub target_interval_ms: i64,
    pub min_block: i64,
    pub max_block: i64,
    /// During the sale: 1 on a node alone on its ledger (nobody to spread the last units to).
    pub endgame_divisor: i64,
    /// Before the sale: the node's cap is what it saw free over this (`engine.endgame_divisor`).
    pub prestart_divisor: i64,
}

impl From<&EngineSettings> for SizingParams {
    fn from(s: &EngineSettings) -> Self {
        Self {
            target_interval_ms: s.lease_target_interval_ms.max(1),
            min_block: s.min_block.max(1),
            max_block: s.max_block.max(1),
            endgame_divisor: if s.sole_node {
                1
            } else {
                s.endgame_divisor.max(1)
            },
            prestart_divisor: s.endgame_divisor.max(1),
        }
    }
}

/// Units demanded over one target interval at `rate_per_sec`.
fn demand(p: &SizingParams, rate_per_sec: f64) -> i64 {
    (rate_per_sec * p.target_interval_ms as f64 / 1000.0).ceil() as i64
}

/// The block to ask for: the demand of one target interval (at least what is waiting now),
/// clamped to `[min_block, max_block]`, and in the end-game never more than
/// `free / endgame_divisor` (but at least one unit), so the last units spread over the nodes
/// that still have demand instead of stranding in one lease.
pub fn block_size(
    p: &SizingParams,
    rate_per_sec: f64,
    waiting: usize,
    free_hint: Option<i64>,
) -> i64 {
    let mut want = demand(p, rate_per_sec)
        .max(waiting as i64)
        .clamp(p.min_block, p.max_block.max(p.min_block));
    if let Some(free) = free_hint {
        want = want.min((free / p.endgame_divisor).max(1));
    }
    want.max(1)
}

/// Ask for the next block when fewer units than this remain: half a target interval of demand,
/// so the grant arrives before the current lease runs out.
pub fn low_water(p: &SizingParams, rate_per_sec: f64) -> i64 {
    (demand(p, rate_per_sec) / 2).clamp(1, p.max_block.max(1))
}

/// Reserves per second over a sliding one-second window.
#[derive(Debug, Clone)]
pub struct RateEstimator {
    window_ms: i64,
    start: Millis,
    count: u64,
    /// The rate of the last complete window.
    prev: f64,
}

impl RateEstimator {
    pub fn new(now: Millis) -> Self {
        Self {
            window_ms: 1000,
            start: now,
            count: 0,
            prev: 0.0,
        }
    }

    /// The clock went back to `now`: the current window starts no later than it.
    pub fn clock_went_back(&mut self, now: Millis) {
        self.start = self.start.min(now);
    }

    fn roll(&mut self, now: Millis) {
        let elapsed = now - self.start;
        if elapsed >= self.window_ms {
            self.prev = if elapsed < 2 * self.window_ms {
                self.count as f64 * 1000.0 / self.window_ms as f64
            } else {
                0.0
            };
            self.start = now;
            self.count = 0;
        }
    }

    pub fn record(&mut self, now: Millis, n: u64) {
        self.roll(now);
        self.count += n;
    }

    /// Takes back `n` recorded requests that turned out not to be demand (repeats, refusals).
    pub fn forget(&mut self, now: Millis, n: u64) {
        self.roll(now);
        self.count = self.count.saturating_sub(n);
    }

    /// The larger of the last full window's rate and the current window's count so far.
    pub fn per_sec(&mut self, now: Millis) -> f64 {
        self.roll(now);
        self.prev
            .max(self.count as f64 * 1000.0 / self.window_ms as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: SizingParams = SizingParams {
        target_interval_ms: 1000,
        min_block: 4,
        max_block: 1000,
        endgame_divisor: 4,
        prestart_divisor: 4,
    };

    #[test]
    fn blocks_follow_demand_within_bounds() {
        assert_eq!(block_size(&P, 0.0, 0, None), 4);
        assert_eq!(block_size(&P, 250.0, 0, None), 250);
        assert_eq!(block_size(&P, 1e9, 0, None), 1000);
        assert_eq!(block_size(&P, 10.0, 300, None), 300);
    }

    #[test]
    fn end_game_shrinks_blocks_to_single_units() {
        assert_eq!(block_size(&P, 250.0, 0, Some(400)), 100);
        assert_eq!(block_size(&P, 250.0, 0, Some(7)), 1);
        assert_eq!(block_size(&P, 250.0, 50, Some(0)), 1);
    }

    #[test]
    fn a_node_alone_on_its_ledger_keeps_whole_blocks_in_the_end_game_but_not_before_the_start() {
        let mut settings = crate::config::Settings::defaults().engine;
        settings.endgame_divisor = 4;
        let shared = SizingParams::from(&settings);
        settings.sole_node = true;
        let alone = SizingParams::from(&settings);
        assert_eq!(block_size(&shared, 250.0, 0, Some(400)), 100);
        assert_eq!(block_size(&alone, 250.0, 0, Some(400)), 250);
        // Never more than is free.
        assert_eq!(block_size(&alone, 250.0, 0, Some(7)), 7);
        assert_eq!((shared.prestart_divisor, alone.prestart_divisor), (4, 4));
    }

    #[test]
    fn low_water_is_half_an_interval_of_demand() {
        assert_eq!(low_water(&P, 0.0), 1);
        assert_eq!(low_water(&P, 400.0), 200);
    }

    #[test]
    fn rate_tracks_the_last_window_and_decays_when_idle() {
        let mut r = RateEstimator::new(0);
        r.record(100, 30);
        assert_eq!(r.per_sec(500), 30.0);
        r.record(1_200, 5);
        assert_eq!(r.per_sec(1_300), 30.0);
        assert_eq!(r.per_sec(2_300), 5.0);
        assert_eq!(r.per_sec(10_000), 0.0);
    }
}
