//! What the engine answers when it cannot do what was asked ([`EngineError`], mapped to HTTP in
//! `api::error`), and the metric outcome of every answer.

use super::Reserved;
use crate::domain::Ineligible;
use crate::ledger::LedgerError;
use crate::metrics::Outcome;

/// What the engine answers when it cannot do what was asked. Mapped to HTTP in `api::error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("not found")]
    NotFound,
    #[error("out of stock")]
    OutOfStock,
    #[error("already used")]
    AlreadyUsed,
    #[error("not eligible: {0:?}")]
    NotEligible(Ineligible),
    #[error("temporarily unavailable")]
    Unavailable,
    /// A rate limit refused the request; the next one may pass after this many seconds.
    #[error("rate limited")]
    RateLimited { retry_after_secs: u64 },
    #[error("already exists")]
    AlreadyExists,
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("reservation was released")]
    ReservationReleased,
    #[error("reservation is already confirmed")]
    AlreadyConfirmed,
}

impl From<LedgerError> for EngineError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::AlreadyExists => Self::AlreadyExists,
            LedgerError::NotFound => Self::NotFound,
            LedgerError::Released => Self::ReservationReleased,
            LedgerError::AlreadyConfirmed => Self::AlreadyConfirmed,
            LedgerError::Invalid(why) => Self::Invalid(why.to_string()),
            LedgerError::Inconsistent(_) => {
                tracing::error!(error = %e, "the ledger's data does not fit together");
                Self::Unavailable
            }
            LedgerError::Fenced
            | LedgerError::NotLive
            | LedgerError::Deadline
            | LedgerError::QueueFull
            | LedgerError::WorkerGone
            | LedgerError::Unreachable { .. }
            | LedgerError::Database { .. }
            | LedgerError::CommitFailed(_)
            | LedgerError::Unanswered(_) => {
                tracing::warn!(error = %e, "ledger call failed");
                Self::Unavailable
            }
            // Said once, when the breaker opened.
            LedgerError::CircuitOpen => Self::Unavailable,
        }
    }
}

/// The metric outcome of a reserve's answer.
pub(crate) fn outcome_of(res: &Result<Reserved, EngineError>) -> Outcome {
    match res {
        Ok(r) if r.replayed => Outcome::Replayed,
        Ok(_) => Outcome::Created,
        Err(e) => error_outcome(e),
    }
}

pub(crate) fn error_outcome(e: &EngineError) -> Outcome {
    match e {
        EngineError::OutOfStock => Outcome::OutOfStock,
        EngineError::AlreadyUsed => Outcome::AlreadyUsed,
        EngineError::NotEligible(_) => Outcome::NotEligible,
        EngineError::NotFound => Outcome::NotFound,
        EngineError::Invalid(_) => Outcome::Invalid,
        EngineError::RateLimited { .. } => Outcome::RateLimited,
        _ => Outcome::Unavailable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ledger fault is never the client's: it is a `503`, not a `400`.
    #[test]
    fn an_inconsistent_ledger_is_unavailable_not_a_bad_request() {
        assert_eq!(
            EngineError::from(LedgerError::Inconsistent("feed_head row missing")),
            EngineError::Unavailable
        );
        assert_eq!(
            EngineError::from(LedgerError::Invalid("totalLimit may only grow")),
            EngineError::Invalid("totalLimit may only grow".into())
        );
    }
}
