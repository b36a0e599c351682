//! What the two SQL ledgers share about their driver, sqlx: its errors turned into
//! [`LedgerError`]s (reachability decided here, once), an insert's unique violation as
//! `AlreadyExists`, and the guard of their migrations against a newer schema. Nothing outside
//! the SQL ledgers and start-up names a sqlx type.

use super::LedgerError;

/// The ledger could not be reached: a connection-level failure, or the server saying the
/// connection failed (SQLSTATE class 08), that it is shutting down or starting (57P0x), or that
/// it takes no writes (25006: a standby, or a primary demoted under the node). Any other error
/// is the database answering.
pub(super) fn unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(d) => d
            .code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57P0") || c == "25006"),
        _ => false,
    }
}

impl From<sqlx::Error> for LedgerError {
    fn from(e: sqlx::Error) -> Self {
        if unreachable(&e) {
            return Self::Unreachable {
                source: Box::new(e),
            };
        }
        Self::Database {
            code: e
                .as_database_error()
                .and_then(|d| d.code())
                .map(|c| c.into_owned()),
            source: Box::new(e),
        }
    }
}

/// Maps a unique violation on insert to [`LedgerError::AlreadyExists`].
pub(super) fn insert_unique<T>(res: Result<T, sqlx::Error>) -> Result<(), LedgerError> {
    match res {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Err(LedgerError::AlreadyExists),
        Err(e) => Err(e.into()),
    }
}

/// Fails when the ledger holds a schema version this build does not know: a newer build
/// migrated it, and this one would write what that schema no longer expects.
pub(super) fn refuse_newer_schema(newest: i64, known: &[(i64, &str)]) -> Result<(), sqlx::Error> {
    let ours = known.iter().map(|(v, _)| *v).max().unwrap_or(0);
    if newest > ours {
        return Err(sqlx::Error::Protocol(format!(
            "the ledger's schema is at version {newest}, newer than this build's {ours}: \
             run the build that migrated it (or a newer one)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_refuses_a_schema_newer_than_it_knows() {
        let known = [(1, ""), (4, "")];
        assert!(refuse_newer_schema(0, &known).is_ok());
        assert!(refuse_newer_schema(4, &known).is_ok());
        assert!(refuse_newer_schema(5, &known).is_err());
    }

    #[test]
    fn connection_failures_are_unreachable_and_the_rest_is_the_database_answering() {
        for e in [
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::WorkerCrashed,
            sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into()),
        ] {
            let e = LedgerError::from(e);
            assert!(matches!(e, LedgerError::Unreachable { .. }), "{e:?}");
        }
        for e in [
            sqlx::Error::RowNotFound,
            sqlx::Error::Protocol("bad answer".into()),
        ] {
            let e = LedgerError::from(e);
            assert!(
                matches!(e, LedgerError::Database { code: None, .. }),
                "{e:?}"
            );
        }
        // The server's codes: a failed connection or a shutdown is out of reach; a deadlock,
        // a lock timeout or a constraint is the database answering, its code kept.
        for code in ["08006", "08P01", "57P01", "57P03"] {
            let e = LedgerError::from(coded(code));
            assert!(
                matches!(e, LedgerError::Unreachable { .. }),
                "{code}: {e:?}"
            );
        }
        for code in ["40P01", "55P03", "23514", "57014", "2067"] {
            match LedgerError::from(coded(code)) {
                LedgerError::Database { code: Some(c), .. } => assert_eq!(c, code),
                e => panic!("{code}: {e:?}"),
            }
        }
    }

    /// A database error with this code, as a driver would report it.
    fn coded(code: &'static str) -> sqlx::Error {
        #[derive(Debug)]
        struct Coded(&'static str);
        impl std::fmt::Display for Coded {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "error {}", self.0)
            }
        }
        impl std::error::Error for Coded {}
        impl sqlx::error::DatabaseError for Coded {
            fn message(&self) -> &str {
                "fake"
            }
            fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
                Some(self.0.into())
            }
            fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
                self
            }
            fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
                self
            }
            fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
                self
            }
            fn kind(&self) -> sqlx::error::ErrorKind {
                sqlx::error::ErrorKind::Other
            }
        }
        sqlx::Error::Database(Box::new(Coded(code)))
    }
}
