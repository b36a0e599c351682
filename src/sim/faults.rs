//! The fault kinds a round may inject, by name on the command line (`--faults crash,pause`) and
//! as a type everywhere else: a kind the simulator asks about that does not exist cannot compile.

use super::rng::Rng;

/// One kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A node crashes (memory lost) and restarts as a new incarnation.
    Crash,
    /// A node pauses past its lease TTL.
    Pause,
    /// A node's clock jumps.
    Clock,
    /// A ledger call fails before it applies.
    LedgerFail,
    /// A ledger call applies but its answer is lost.
    LedgerLost,
    /// A ledger call answers late (or commits after its caller got 503).
    LedgerSlow,
    /// A signal is dropped (the receiver's link breaks and comes back).
    SignalDrop,
    /// A signal is delayed (so reordered).
    SignalDelay,
    /// A signal arrives twice.
    SignalDup,
    /// Redis is down for a while.
    RedisDown,
    /// Copies of one order go to two nodes, and resends follow a 201.
    Copies,
    /// Operators pause sales (the switches).
    Switches,
    /// Operators raise a total.
    Raise,
    /// Customers release reservations.
    Release,
    /// Customers confirm reservations.
    Confirm,
    /// One shard of the ledger is down on its own for a while (rounds with several shards).
    ShardDown,
    /// One shard answers late on its own for a while (rounds with several shards).
    ShardSlow,
}

impl Fault {
    /// Every kind, in the order `names` lists them.
    pub const ALL: [Fault; 17] = [
        Fault::Crash,
        Fault::Pause,
        Fault::Clock,
        Fault::LedgerFail,
        Fault::LedgerLost,
        Fault::LedgerSlow,
        Fault::SignalDrop,
        Fault::SignalDelay,
        Fault::SignalDup,
        Fault::RedisDown,
        Fault::Copies,
        Fault::Switches,
        Fault::Raise,
        Fault::Release,
        Fault::Confirm,
        Fault::ShardDown,
        Fault::ShardSlow,
    ];

    /// The kind's name on the command line and in replay commands.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Crash => "crash",
            Fault::Pause => "pause",
            Fault::Clock => "clock",
            Fault::LedgerFail => "ledger-fail",
            Fault::LedgerLost => "ledger-lost",
            Fault::LedgerSlow => "ledger-slow",
            Fault::SignalDrop => "signal-drop",
            Fault::SignalDelay => "signal-delay",
            Fault::SignalDup => "signal-dup",
            Fault::RedisDown => "redis-down",
            Fault::Copies => "copies",
            Fault::Switches => "switches",
            Fault::Raise => "raise",
            Fault::Release => "release",
            Fault::Confirm => "confirm",
            Fault::ShardDown => "shard-down",
            Fault::ShardSlow => "shard-slow",
        }
    }

    fn bit(self) -> u32 {
        1 << self as u32
    }
}

/// A set of fault kinds (a bit set; bit `i` is `Fault::ALL[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Faults(u32);

impl Faults {
    pub fn all() -> Self {
        Self(Fault::ALL.iter().fold(0, |a, f| a | f.bit()))
    }

    pub fn none() -> Self {
        Self(0)
    }

    pub(super) fn has(self, kind: Fault) -> bool {
        self.0 & kind.bit() != 0
    }

    /// The kinds in this set.
    pub fn kinds(self) -> Vec<Fault> {
        Fault::ALL.into_iter().filter(|&f| self.has(f)).collect()
    }

    pub fn without(self, kind: Fault) -> Self {
        Self(self.0 & !kind.bit())
    }

    /// `crash,pause,…` (or `none`).
    pub fn names(self) -> String {
        let kinds: Vec<&str> = self.kinds().into_iter().map(Fault::name).collect();
        if kinds.is_empty() {
            "none".into()
        } else {
            kinds.join(",")
        }
    }

    /// Parses [`Faults::names`]' form (`all` too).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "all" => return Ok(Self::all()),
            "none" | "" => return Ok(Self::none()),
            _ => {}
        }
        s.split(',').try_fold(Self::none(), |acc, name| {
            Fault::ALL
                .iter()
                .find(|f| f.name() == name)
                .map(|f| Self(acc.0 | f.bit()))
                .ok_or_else(|| format!("unknown fault kind {name:?}"))
        })
    }

    /// A random subset of `self` (each kind with even odds).
    pub(super) fn draw(self, rng: &mut Rng) -> Self {
        Self(self.0 & rng.next() as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bits_are_distinct() {
        assert_eq!(Faults::parse(&Faults::all().names()), Ok(Faults::all()));
        for f in Fault::ALL {
            assert_eq!(Faults::parse(f.name()).map(|s| s.kinds()), Ok(vec![f]));
            assert!(!Faults::all().without(f).has(f));
        }
        assert!(Faults::parse("crsh").is_err());
    }
}
